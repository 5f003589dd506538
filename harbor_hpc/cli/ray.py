"""`harbor-hpc ray up / status / down`: a Ray cluster on Slurm for environments to run on."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from harbor_hpc.cli.app import (
    AccountOption,
    JsonOption,
    PartitionOption,
    QosOption,
    SbatchArgOption,
    SetupOption,
    VerboseOption,
    app,
    info,
    placement,
    render,
    setup,
    stdout,
)

if TYPE_CHECKING:  # the cluster code loads when a command runs: `--help` stays quick
    from harbor_hpc.ray.cluster import RayCluster, RayDown, RayStatus

ray_app = typer.Typer(
    name="ray",
    short_help="A Ray cluster as one Slurm job, for environments elsewhere.",
    help="A Ray cluster as one Slurm job (token authentication always on), for environments "
    "that run away from the trainer's nodes. Needs the extra: pip install 'harbor-hpc[ray]'.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(ray_app)

ClusterDirOption = Annotated[
    Path | None,
    typer.Option(
        "--cluster-dir",
        help="The cluster's private folder (token, job script, log, address), on a filesystem "
        "the nodes share. [default: $HARBOR_HPC_RAY_DIR, else ~/.local/state/harbor-hpc/ray]",
        show_default=False,
    ),
]


@ray_app.command(short_help="Start a Ray cluster as one Slurm job; wait until it is up.")
def up(
    nodes: Annotated[
        int, typer.Option("--nodes", "-N", min=1, help="Slurm nodes, one Ray node on each.")
    ],
    partition: PartitionOption = None,
    time_min: Annotated[
        int, typer.Option("--time", min=1, help="Minutes the cluster lives (Slurm time limit).")
    ] = 60,
    cpus_per_node: Annotated[
        int | None,
        typer.Option("--cpus-per-node", min=1, help="CPUs of each Ray node. [default: Slurm's, 1]"),
    ] = None,
    mem_per_node: Annotated[
        int | None,
        typer.Option(
            "--mem-per-node",
            min=0,
            help="MB of memory the job asks of each node (0: all of it). [default: the "
            "site's default memory for jobs (DefMemPerCPU), else half the partition's biggest "
            "node, leaving room for the batches beside it]",
        ),
    ] = None,
    ray_nodes_per_node: Annotated[
        int,
        typer.Option(
            "--ray-nodes-per-node",
            min=1,
            help="Ray nodes on each Slurm node, each with its own node id (a multi-node Ray "
            "cluster on one machine).",
        ),
    ] = 1,
    labels: Annotated[
        str | None,
        typer.Option(
            "--labels",
            help="Labels of every node of the job, key=value,... (Ray's node labels): "
            "environments select nodes by them (environment kwarg ray_labels).",
        ),
    ] = None,
    join: Annotated[
        str | None,
        typer.Option(
            "--join",
            help="The address of a running Ray cluster (a trainer's) for the job's nodes to "
            "join as workers, instead of a cluster of their own. Needs --token-file.",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            exists=True,
            dir_okay=False,
            help="The token file of the cluster to --join (it is linked to, never copied).",
        ),
    ] = None,
    account: AccountOption = None,
    qos: QosOption = None,
    sbatch_arg: SbatchArgOption = None,
    setup_line: SetupOption = None,
    wait_timeout: Annotated[
        float | None,
        typer.Option(
            "--wait-timeout",
            min=1,
            help="Seconds to wait for the job to start and every node to join; then the job "
            "is cancelled. [default: 600]",
        ),
    ] = None,
    cluster_dir: ClusterDirOption = None,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Start a Ray cluster as one Slurm job and wait until every node joined.

    The head runs on the first node, workers on the others. Each cluster gets a random token
    in a 0600 file of yours (never on a command line, in a log or in --json): connect with
    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<token_file> RAY_ADDRESS=<address>.

    With --join, the job's nodes join a cluster already running (a trainer's on GPU nodes,
    say) as workers; `ray down` then ends only them.

    Example: harbor-hpc ray up --nodes 2 --partition cpu --time 240
    Example: harbor-hpc ray up --nodes 4 --partition cpu --labels role=env \\
                 --join 10.0.0.5:6379 --token-file ~/trainer/ray-token
    """
    from harbor_hpc.ray import cluster

    config = setup(verbose)
    options = cluster.UpOptions(
        nodes=nodes,
        placement=placement(config, partition, account, qos, time_min, sbatch_arg, setup_line),
        cpus_per_node=cpus_per_node,
        mem_mb_per_node=mem_per_node,
        ray_nodes_per_node=ray_nodes_per_node,
        labels=labels,
        join=join,
        token_file=token_file,
    )
    where = cluster_dir or cluster.default_cluster_dir()
    timeout = cluster.UP_TIMEOUT_S if wait_timeout is None else wait_timeout
    render(cluster.up(where, options, timeout=timeout, say=info), json=json, show=_show_up)


def _show_up(result: RayCluster) -> None:
    what = f"{result.nodes} Ray node(s) joined" if result.joined else "Ray cluster up:"
    stdout.print(f"{what} {result.address} (Slurm job {result.job_id})", highlight=False)
    stdout.print(
        f"connect with RAY_ADDRESS={result.address} RAY_AUTH_MODE=token "
        f"RAY_AUTH_TOKEN_PATH={escape(result.token_file)}",
        highlight=False,
    )


@ray_app.command(short_help="The cluster's job, each Ray node and its free resources.")
def status(
    cluster_dir: ClusterDirOption = None,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Show the cluster's Slurm job, its Ray nodes, their free resources and labels.

    Example: harbor-hpc ray status --json
    """
    setup(verbose)
    from harbor_hpc.ray import cluster

    render(cluster.status(cluster_dir or cluster.default_cluster_dir()), json=json, show=_show)


def _show(result: RayStatus) -> None:
    state = result.job_state or "ended"
    stdout.print(
        f"Ray cluster {result.cluster.address}: Slurm job {result.cluster.job_id} {state}",
        highlight=False,
    )
    if result.unreachable:
        stdout.print(
            f"{result.unreachable}\n(its head is lost: `harbor-hpc ray down` ends the job)",
            highlight=False,
        )
    if not result.nodes:
        return
    table = Table(pad_edge=False)
    columns = ("node", "ip", "status", "CPU free/total", "memory GB free/total", "labels")
    for column in columns:
        table.add_column(column)
    for node in result.nodes:
        table.add_row(
            node.node_id[:12] + (" (head)" if node.head else ""),
            node.ip,
            node.status,
            f"{node.available.get('CPU', 0):g}/{node.total.get('CPU', 0):g}",
            f"{node.available.get('memory', 0) / 1e9:.1f}/{node.total.get('memory', 0) / 1e9:.1f}",
            ",".join(f"{key}={value}" for key, value in sorted(node.labels.items())),
        )
    stdout.print(table)


@ray_app.command(short_help="End the cluster: cancel its job, remove its token.")
def down(
    cluster_dir: ClusterDirOption = None,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """End the cluster: cancel its Slurm job and remove its token (after --join: only the
    nodes it added, and the link to the cluster's token).

    Example: harbor-hpc ray down --cluster-dir ~/ray/grpo
    """
    setup(verbose)
    from harbor_hpc.ray import cluster

    render(cluster.down(cluster_dir or cluster.default_cluster_dir()), json=json, show=_show_down)


def _show_down(result: RayDown) -> None:
    stdout.print(f"Ray cluster ended (Slurm job {result.job_id} cancelled)", highlight=False)
