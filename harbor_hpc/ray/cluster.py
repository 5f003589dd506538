"""`harbor-hpc ray up / status / down`: a Ray cluster as one Slurm job of the user's.

A cluster lives in a folder of the user's (`cluster_dir`, 0700, on a filesystem the nodes
share: the home by default) holding its token (0600), the batch script, the job's log,
`cluster.json` (job id and address) and the head's address file. The token is generated per
cluster and reaches Ray only as that file's path (RAY_AUTH_TOKEN_PATH): never a command line,
a log or `--json`, so another user can neither read it nor connect without it.

`up` queues the job (`harbor_hpc.ray.node` on each node), then waits until the head wrote its
address and every node joined (with `join`, the job's nodes join a cluster already running, a
trainer's, through a link to that cluster's token file, and `down` ends only them); a job
that ends or does not come up in time is cancelled and its log named. Nodes are asked of Ray's
GCS directly, which any host that reaches the head can do: no Ray driver is started.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import secrets
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

from harbor_hpc.core.cluster_name import slurm_cluster_name
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.files import atomic_write_json, atomic_write_text, read_json
from harbor_hpc.ray.node import address_file, failures, use_token
from harbor_hpc.slurm.cluster import SlurmPlacement

INSTALL_HINT = (
    "install the extra: pip install 'harbor-hpc[ray]' (in a checkout: uv sync --extra ray)"
)
# How long `up` waits for the job to start and every node to join, and how often it looks.
UP_TIMEOUT_S = 600.0
# How long a cluster lives when the placement names no time.
UP_TIME_MIN = 60
POLL_S = 1.0


def default_cluster_dir() -> Path:
    """$HARBOR_HPC_RAY_DIR, else ~/.local/state/harbor-hpc/ray/SLURM_CLUSTER (the home: nodes
    share it), a folder per Slurm cluster: a home shared by two clusters (another SLURM_CONF)
    keeps a Ray cluster of each."""
    chosen = os.environ.get("HARBOR_HPC_RAY_DIR")
    if chosen:
        return Path(chosen)
    return Path.home() / ".local" / "state" / "harbor-hpc" / "ray" / slurm_cluster_name()


def ray_missing() -> str | None:
    """Why Ray cannot be used here, or None when it can. Looked up, not imported: Ray reads its
    authentication settings once, when imported (`_ray_modules`)."""
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed"
    return None


def _ray_modules(cluster_dir: Path | None) -> tuple[ModuleType, ModuleType, ModuleType]:
    """Ray's GCS client, its status reader and node states, imported only when asked for, in
    this process set up to ask the cluster in `cluster_dir` (None: with the token settings
    already in the environment): Ray reads them from the environment once, when imported."""
    if cluster_dir is not None:
        use_token(os.environ, cluster_dir)
    problem = ray_missing()
    if problem:
        raise InputError(problem, hint=INSTALL_HINT)
    return (
        # Ray has no public GCS client (checked with Ray 2.60): its private one, here only;
        # tests/ray/test_cluster.py (`ray up`, `ray status`) fails at once should it move.
        importlib.import_module("ray._raylet"),
        importlib.import_module("ray.autoscaler.v2.sdk"),
        importlib.import_module("ray.core.generated.autoscaler_pb2"),
    )


def alive_node_ips(address: str, cluster_dir: Path | None = None) -> set[str]:
    """The addresses of the alive nodes of the cluster at `address` (asked of its GCS, with the
    token of the `ray up` cluster in `cluster_dir`, else the settings already in this process's
    environment)."""
    return {node.ip for node in _alive(_nodes_at(address, _ray_modules(cluster_dir)))}


@dataclass(frozen=True)
class UpOptions:
    nodes: int
    # Where the job goes and how long the cluster lives (`UP_TIME_MIN` unless it says).
    placement: SlurmPlacement
    cpus_per_node: int | None = None
    # The memory the job asks of each Slurm node, in MB (0: all of it, as Slurm reads
    # --mem=0); None: the site's default, else half the partition's biggest node, leaving the
    # rest to the batches beside it (`memory_per_node`).
    mem_mb_per_node: int | None = None
    # Ray nodes on each Slurm node: several make a multi-node Ray cluster of one machine (each
    # with its own node id and temporary folder), for tests or a fleet of small nodes.
    ray_nodes_per_node: int = 1
    # Labels of every node of the job (`key=value,...`), for environments to select
    # (`ray_labels`): CPU nodes that serve environments, say, in a trainer's cluster.
    labels: str | None = None
    # The address of a cluster already running (a trainer's) for the job's nodes to join as
    # workers, with that cluster's token file, instead of starting a cluster of their own.
    join: str | None = None
    token_file: Path | None = None

    @property
    def ray_nodes(self) -> int:
        return self.nodes * self.ray_nodes_per_node


@dataclass(frozen=True)
class RayCluster:
    """A cluster `up` started, or the nodes it added to one (`joined`): what `cluster.json`
    keeps and `--json` prints (no token)."""

    address: str
    job_id: str
    nodes: int
    cluster_dir: str
    token_file: str
    log: str
    joined: bool = False
    labels: str | None = None
    # The Slurm cluster its job runs on (ClusterName): only from there can its job be asked.
    slurm_cluster: str | None = None
    mem_mb_per_node: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    status: str
    head: bool
    total: dict[str, float]
    available: dict[str, float]
    labels: dict[str, str]  # the node's own (`--labels`), without Ray's `ray.io/` ones

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RayStatus:
    cluster: RayCluster
    job_state: str | None
    nodes: list[RayNode]
    # Why a running job's cluster cannot be asked (its head lost, say), else None.
    unreachable: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            **self.cluster.to_json(),
            "job_state": self.job_state,
            "ray_nodes": [node.to_json() for node in self.nodes],
            "unreachable": self.unreachable,
        }


@dataclass(frozen=True)
class RayDown:
    job_id: str
    cluster_dir: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _cluster_file(cluster_dir: Path) -> Path:
    return cluster_dir / "cluster.json"


def _private_dir(cluster_dir: Path) -> None:
    cluster_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    cluster_dir.chmod(0o700)


def job_script(cluster_dir: Path, options: UpOptions) -> str:
    """The batch script (slurm/ray_job.sh): one task per Ray node, each running
    `harbor_hpc.ray.node`."""
    cpus = [f"#SBATCH --cpus-per-task={options.cpus_per_node}"] if options.cpus_per_node else []
    if options.mem_mb_per_node is not None:
        cpus.append(f"#SBATCH --mem={options.mem_mb_per_node}M")
    node = [sys.executable, "-m", "harbor_hpc.ray.node", str(cluster_dir)]
    node += ["--join", options.join] if options.join else []
    node += ["--labels", options.labels] if options.labels else []
    values = {
        "nodes": str(options.nodes),
        "tasks_per_node": str(options.ray_nodes_per_node),
        "time_min": str(options.placement.time_min or UP_TIME_MIN),
        "log": str(cluster_dir / "job-%j.log"),
        "sbatch": "\n".join(cpus + options.placement.script_lines()),
        "node": shlex.join(node),
    }
    return options.placement.render("ray_job.sh", values)


def parse_labels(text: str | None) -> dict[str, str]:
    """`key=value,key2=value2` (Ray's node labels, or with `!value` its label selectors) as a
    dict; a ValueError names the item that is not key=value."""
    pairs = [item.partition("=") for item in (text or "").split(",") if item.strip()]
    bad = ["".join(pair).strip() for pair in pairs if not pair[1] or not pair[0].strip()]
    if bad:
        raise ValueError(f"{bad[0]!r} is not key=value")
    return {key.strip(): value.strip() for key, _, value in pairs}


def load(cluster_dir: Path) -> RayCluster:
    path = _cluster_file(cluster_dir)
    if not path.exists():
        raise InputError(
            f"no Ray cluster in {cluster_dir}",
            hint="start one with `harbor-hpc ray up`, or pass the --cluster-dir it used",
        )
    try:
        return RayCluster(**read_json(path))
    except TypeError:
        raise InputError(
            f"{path}: not a cluster file of harbor-hpc", hint="remove it, and end its job by hand"
        ) from None


def up(
    cluster_dir: Path,
    options: UpOptions,
    *,
    timeout: float = UP_TIMEOUT_S,
    say: Callable[[str], None] = lambda message: None,
) -> RayCluster:
    """Start a cluster and return once all its nodes joined; `say` hears the job id and log
    as soon as Slurm took the job, and why it pends while it does."""
    from harbor_hpc.slurm import cluster as slurm  # submitit loads when Slurm is asked

    modules = _ray_modules(cluster_dir)
    if options.token_file is not None and not options.join:
        raise InputError("--token-file goes with --join (a cluster of its own makes its token)")
    if options.ray_nodes < 1:
        raise InputError(f"{options.ray_nodes} Ray nodes: a cluster needs at least one")
    try:
        labels = parse_labels(options.labels)
    except ValueError as exc:
        raise InputError(f"--labels {options.labels!r}: {exc}", hint="e.g. role=env") from None
    # As `ray start` takes them: no empty items, no spaces around the parts.
    options = replace(options, labels=",".join(f"{k}={v}" for k, v in labels.items()) or None)
    here = slurm_cluster_name()
    if _cluster_file(cluster_dir).exists():
        running = load(cluster_dir)
        if running.slurm_cluster not in (None, here):
            # Its job cannot be asked from this cluster: it may well live on its own.
            raise InputError(
                f"{cluster_dir} holds a Ray cluster of Slurm cluster {running.slurm_cluster} "
                f"(job {running.job_id}, {running.address}), not of {here}, whose jobs alone "
                "can be asked from here",
                hint="pass another --cluster-dir (each Slurm cluster has its own by default), "
                f"or `harbor-hpc ray down` it from {running.slurm_cluster}",
            )
        if slurm.job_state(running.job_id) is not None:
            raise InputError(
                f"a Ray cluster is already up in {cluster_dir} (job {running.job_id}, "
                f"{running.address})",
                hint="end it with `harbor-hpc ray down`, or pass another --cluster-dir",
            )
    options = replace(options, mem_mb_per_node=memory_per_node(options))
    _private_dir(cluster_dir)
    token = cluster_dir / "token"
    token.unlink(missing_ok=True)
    if options.join:
        # The cluster's own token file, linked (never copied): the nodes read it through the link.
        if options.token_file is None:
            raise InputError(
                f"joining {options.join} needs that cluster's token file", hint="pass --token-file"
            )
        token.symlink_to(options.token_file.resolve())
    else:
        atomic_write_text(token, secrets.token_hex(32) + "\n", mode=0o600)
    script = cluster_dir / "job.sh"
    atomic_write_text(script, job_script(cluster_dir, options), mode=0o700)
    job_id: str | None = None
    try:
        # Nodes already there, when joining: `up` waits for this many more.
        before = len(_alive(_nodes_at(options.join, modules))) if options.join else 0
        job_id = slurm.submit_script(
            script, what="the Ray cluster job", hint="check --partition, --time and --nodes"
        )
        log = cluster_dir / f"job-{job_id}.log"
        mem = options.mem_mb_per_node
        asked = (
            "all its memory" if mem == 0 else f"{mem} MB" if mem else "the site's default memory"
        )
        say(
            f"Slurm job {job_id}: {options.ray_nodes} Ray node(s), {asked} a node "
            f"(--mem-per-node), log in {log}; waiting"
        )
        job = _JobWatch(job_id, log, say)
        address = options.join or _await_address(cluster_dir, job, timeout)
        cluster = RayCluster(
            address,
            job_id,
            options.ray_nodes,
            str(cluster_dir),
            str(token),
            str(log),
            joined=bool(options.join),
            labels=options.labels,
            slurm_cluster=here,
            mem_mb_per_node=options.mem_mb_per_node,
        )
        atomic_write_json(_cluster_file(cluster_dir), cluster.to_json())
        _await_nodes(cluster, modules, before + cluster.nodes, job, timeout)
    except BaseException:
        # No half cluster: its job, its token and what names it go (the log stays).
        if job_id is not None:
            slurm.cancel(job_id)
            address_file(cluster_dir, job_id).unlink(missing_ok=True)
        _cluster_file(cluster_dir).unlink(missing_ok=True)
        token.unlink(missing_ok=True)
        raise
    return cluster


def memory_per_node(options: UpOptions) -> int | None:
    """What the job asks of each node, in MB: the option; else, where the site gives jobs no
    default memory (DefMemPerCPU, DefMemPerNode), half the partition's biggest node: a job that
    asks for none then gets every node's whole memory where Slurm counts it, and a batch beside
    it waits for the cluster's end. None: Slurm's default, the site's."""
    if options.mem_mb_per_node is not None:
        return options.mem_mb_per_node
    from harbor_hpc.slurm import cluster as slurm  # submitit loads when Slurm is asked

    config = slurm.config()
    if any(_set(config.get(key)) for key in ("DefMemPerCPU", "DefMemPerNode")):
        return None
    limits = slurm.partition_limits(options.placement.partition)
    return limits.mem_mb // 2 if limits is not None and limits.mem_mb > 1 else None


def _set(value: str | None) -> bool:
    """A memory default of `scontrol show config` that is one (not UNLIMITED, 0, or absent)."""
    return bool(value) and value not in ("UNLIMITED", "0")


# Slurm's reasons for a job that asks for more than its partition, QOS or account gives: it may
# wait for good (or until nodes come back).
_BEYOND_LIMITS = ("Partition", "QOSMax", "AssocMax", "ReqNodeNotAvail")
_BEYOND = "more than the partition or your limits give: check --nodes, --time and --cpus-per-node"
_BEYOND_HINT = f" ({_BEYOND}; Ctrl-C cancels the job)"


class _JobWatch:
    """The cluster's job while `up` waits for it: whether it is still queued, and why it
    pends (told once per reason: Resources, Priority, a QOS limit...)."""

    def __init__(self, job_id: str, log: Path, say: Callable[[str], None]) -> None:
        self.job_id = job_id
        self.log = log
        self._say = say
        self._told: tuple[str, str] | None = None

    def pending_since(self) -> str:
        """ ", pending (Slurm: REASON)" while the job has not started, else nothing."""
        if self._told is None or self._told[0] != "PENDING":
            return ""
        return f", pending (Slurm: {self._told[1]})"

    def failures(self) -> str:
        """What the job's nodes said when Ray would not start on them."""
        return "; ".join(failures(self.log.parent, self.job_id))

    def what_to_check(self) -> str:
        if self._told is not None and self._told[1].startswith(_BEYOND_LIMITS):
            return f"it asks for {_BEYOND}"
        if self.log.exists():
            return f"see its log {self.log}"
        return "is the partition busy (`squeue`)? a longer --wait-timeout waits for it"

    def queued(self) -> bool:
        from harbor_hpc.slurm import cluster as slurm  # submitit loads when Slurm is asked

        status = slurm.job_status(self.job_id)
        if status is None:
            return False
        state, reason = status
        if state == "PENDING" and slurm.never_starts(reason):
            raise HarborHpcError(
                f"Slurm will never start the Ray cluster job {self.job_id} ({reason}: it asks "
                f"for {_BEYOND}); cancelled it",
                hint="ask for fewer --nodes, a shorter --time, less --mem-per-node, or "
                "another --partition",
            )
        if state == "PENDING" and reason != "None" and status != self._told:
            hint = _BEYOND_HINT if reason.startswith(_BEYOND_LIMITS) else ""
            self._say(f"Slurm job {self.job_id} is pending: {reason}{hint}")
            self._told = status
        elif state != "PENDING" and self._told is not None and self._told[0] == "PENDING":
            self._say(f"Slurm job {self.job_id} is {state.lower()}")
            self._told = status
        return True


def _await[T](ready: Callable[[], T], job: _JobWatch, timeout: float, waiting_for: str) -> T:
    """What `ready` returns once it is true, polling; the job ending or `timeout`
    passing first is an error naming the log."""
    deadline = time.monotonic() + timeout
    while True:
        answer = ready()
        if answer:
            return answer
        failures = job.failures()
        if failures:  # a node that could not start Ray: the cluster would lack it
            raise HarborHpcError(
                f"Ray cluster job {job.job_id}: {failures}; cancelled it",
                hint=f"see its log {job.log}",
            )
        if not job.queued():
            failures = job.failures()
            raise HarborHpcError(
                f"Ray cluster job {job.job_id} ended while waiting for {waiting_for}"
                + (f": {failures}" if failures else ""),
                hint=f"see its log {job.log}",
            )
        if time.monotonic() > deadline:
            raise HarborHpcError(
                f"Ray cluster job {job.job_id}: still waiting for {waiting_for} after "
                f"{timeout:g} s{job.pending_since()}; cancelled it",
                hint=job.what_to_check(),
            )
        time.sleep(POLL_S)


def _await_address(cluster_dir: Path, job: _JobWatch, timeout: float) -> str:
    path = address_file(cluster_dir, job.job_id)

    def address() -> str:
        return path.read_text().strip() if path.exists() else ""

    return _await(address, job, timeout, "the head's address")


def _await_nodes(
    cluster: RayCluster,
    modules: tuple[ModuleType, ModuleType, ModuleType],
    count: int,
    job: _JobWatch,
    timeout: float,
) -> None:
    def joined() -> bool:
        return len(_alive(_nodes(cluster, modules))) >= count

    _await(joined, job, timeout, f"{cluster.nodes} Ray node(s)")


def _alive(nodes: list[RayNode]) -> list[RayNode]:
    return [node for node in nodes if node.status != "DEAD"]


def _nodes(
    cluster: RayCluster, modules: tuple[ModuleType, ModuleType, ModuleType]
) -> list[RayNode]:
    return _nodes_at(cluster.address, modules, job_id=cluster.job_id)


def _nodes_at(
    address: str,
    modules: tuple[ModuleType, ModuleType, ModuleType],
    job_id: str | None = None,
) -> list[RayNode]:
    """Each node the GCS at `address` knows, with its total and free resources."""
    raylet, sdk, autoscaler = modules
    try:
        client = raylet.GcsClient(address=address)
        state = sdk.get_cluster_resource_state(client)
    except Exception as exc:  # Ray raises its own RPC and authentication errors
        job = f" (job {job_id})" if job_id else ""
        raise HarborHpcError(
            f"the Ray cluster at {address}{job} does not answer: "
            f"{' '.join(str(exc).split())[:200]}",
            hint="`harbor-hpc ray status` shows whether its job still runs"
            if job_id
            else f"is {address} the cluster's GCS address, and its token file the right one?",
        ) from None
    return [
        RayNode(
            node_id=node.node_id.hex(),
            ip=node.node_ip_address,
            status=autoscaler.NodeStatus.Name(node.status),
            head="node:__internal_head__" in node.total_resources,
            total=_resources(node.total_resources),
            available=_resources(node.available_resources),
            labels={k: v for k, v in node.labels.items() if not k.startswith("ray.io/")},
        )
        for node in state.node_states
    ]


def _resources(resources: Any) -> dict[str, float]:
    """CPU, GPU, memory and custom resources; Ray's per-node markers (`node:IP`) left out."""
    return {key: float(value) for key, value in resources.items() if not key.startswith("node:")}


def status(cluster_dir: Path) -> RayStatus:
    """The cluster's job state and, while it runs, its nodes and their free resources."""
    from harbor_hpc.slurm import cluster as slurm  # submitit loads when Slurm is asked

    cluster = load(cluster_dir)
    state = slurm.job_state(cluster.job_id)
    if state != "RUNNING":
        return RayStatus(cluster, state, [])
    problem = ray_missing()
    if problem:  # not the cluster's fault: it cannot be asked from here
        raise InputError(
            f"{problem} here: the nodes of the Ray cluster at {cluster.address} (Slurm job "
            f"{cluster.job_id}, {state}) cannot be asked",
            hint=INSTALL_HINT,
        )
    try:
        return RayStatus(cluster, state, _nodes(cluster, _ray_modules(cluster_dir)))
    except HarborHpcError as exc:  # the head's node lost, its GCS gone: the job may live on
        return RayStatus(cluster, state, [], unreachable=exc.message)


def down(cluster_dir: Path) -> RayDown:
    """Cancel the cluster's job and forget it; its token goes with it."""
    from harbor_hpc.slurm import cluster as slurm  # submitit loads when Slurm is asked

    cluster = load(cluster_dir)
    slurm.cancel(cluster.job_id)
    _cluster_file(cluster_dir).unlink()
    address_file(cluster_dir, cluster.job_id).unlink(missing_ok=True)
    Path(cluster.token_file).unlink(missing_ok=True)
    return RayDown(cluster.job_id, str(cluster_dir))
