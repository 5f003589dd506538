"""`harbor-hpc doctor`: what this machine has for the cluster or the build role, and what to fix."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from harbor_hpc.cli.app import (
    AccountOption,
    CacheDirOption,
    JsonOption,
    PartitionOption,
    QosOption,
    SbatchArgOption,
    SetupOption,
    VerboseOption,
    app,
    console,
    info,
    placement,
    render,
    setup,
    stdout,
)
from harbor_hpc.core.errors import HarborHpcError, ReportedFailure
from harbor_hpc.steps.doctor import (
    ASK_TIMEOUT_S,
    PART_TITLES,
    REQUIRED_PARTS,
    NodesReport,
    Report,
    Role,
    Status,
    ask_nodes,
    run_doctor,
)

_STYLES = {Status.OK: "green", Status.WARN: "yellow", Status.MISSING: "red bold"}


@app.command(short_help="Check this machine part by part, with a fix for each gap.")
def doctor(
    role: Annotated[
        Role,
        typer.Option(
            "--role",
            help="cluster: Apptainer + Slurm (login/compute nodes); build: Docker or Apptainer "
            "builds; all: both.",
        ),
    ] = Role.CLUSTER,
    cache_dir: CacheDirOption = None,
    nodes: Annotated[
        bool,
        typer.Option(
            "--nodes",
            help="Ask every node of the partition, one small job each, whether its Apptainer "
            "reads zstd images; every .sif made after is zstd only where all of them do.",
        ),
    ] = False,
    partition: PartitionOption = None,
    account: AccountOption = None,
    qos: QosOption = None,
    sbatch_arg: SbatchArgOption = None,
    setup_line: SetupOption = None,
    timeout: Annotated[
        float,
        typer.Option("--timeout", help="With --nodes: how long to wait for the answers (s)."),
    ] = ASK_TIMEOUT_S,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Check what this machine has for a role: each part probed for real, each gap with a fix.

    Exits 0 when the parts the role needs work, 1 otherwise.

    cluster: Apptainer runs a tiny image here (built once into the cache), Slurm answers.

    build: the Docker Engine answers (through DOCKER_HOST or the default socket), or Apptainer
    builds work for you (a real `apptainer build --fakeroot`, subuid ranges, scratch space).

    --nodes: ask each node of the partition (a job each, on the node) whether it reads the
    zstd images that start containers faster; exits 1 when some node did not answer.

    Example: harbor-hpc doctor --role all --cache-dir /scratch/$USER/sif --json
    """
    if nodes:
        config = setup(verbose)
        where = placement(config, partition, account, qos, None, sbatch_arg, setup_line)
        answers = ask_nodes(where, cache_dir, timeout=timeout, say=info)
        render(answers, json=json, show=_show_nodes)
        if not answers.ok:
            raise ReportedFailure
        return
    try:
        setup(verbose)
        config_problem = None
    except HarborHpcError as exc:  # a broken config file is one more finding, not the end
        config_problem = exc
    report = run_doctor(role, cache_dir)
    render(report, json=json, show=lambda shown: _print_trimmed(_checklist(shown)))
    if config_problem is not None:
        console.print(
            f"[yellow]warning:[/] config ignored: {config_problem.message}", highlight=False
        )
    if not report.ok:
        names = ", ".join(PART_TITLES[part] for part in report.missing_parts)
        needed = " + ".join(
            " or ".join(PART_TITLES[part] for part in choice) for choice in REQUIRED_PARTS[role]
        )
        console.print(
            f"[red bold]not ready[/] for {_roles(role)} ({needed}): {names} missing; "
            "each fix is above",
            highlight=False,
        )
        raise ReportedFailure
    console.print(f"[green]ready[/] for {_roles(role)}", highlight=False)


def _show_nodes(report: NodesReport) -> None:
    asked = report.asked
    grid = Table.grid(padding=(0, 2))
    for _ in range(3):
        grid.add_column()
    grid.add_row(
        Text("node", style="bold"), Text("apptainer", style="bold"), Text("zstd", style="bold")
    )
    for answer in asked.answers:
        reads = (
            Text("reads", style="green")
            if answer.reads_zstd
            else Text(f"cannot: {answer.said}", style="red")
        )
        grid.add_row(answer.node, answer.apptainer or "-", reads)
    for node in asked.unanswered:
        grid.add_row(node, "-", Text("no answer (down, drained or still queued)", style="yellow"))
    stdout.print(Text(f"nodes of {asked.key}", style="bold"))
    _print_trimmed(grid)
    stdout.print(f"images from now on: {report.compression.name} ({report.compression.why})")


def _print_trimmed(renderable: RenderableType) -> None:
    """Print without the blanks a grid pads its lines with to its width: pasted into an issue
    or a chat, the checklist drags none."""
    with stdout.capture() as captured:
        stdout.print(renderable)
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    sys.stdout.flush()


def _roles(role: str) -> str:
    return "every role" if role == "all" else f"the {role} role"


def _checklist(report: Report) -> Group:
    """One line per check under its part, status first; a check that is not ok says its fix
    on the line below. Text wraps at words, at any width."""
    rows: list[RenderableType] = [Text(f"harbor-hpc doctor ({report.role} role)", style="bold")]
    previous = None
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=7, no_wrap=True)
    grid.add_column()
    for check in report.checks:
        if check.part != previous:
            if previous is not None:
                rows.append(grid)
                grid = Table.grid(padding=(0, 1))
                grid.add_column(width=7, no_wrap=True)
                grid.add_column()
            rows.append(Text(f"\n{PART_TITLES[check.part]} ({check.role})", style="bold"))
            previous = check.part
        line = Text(f"{check.name}: ")
        line.append(check.detail)
        if check.status is not Status.OK and check.fix:
            instead = report.working_alternative(check.part)
            line.append("\nfix: ", style="bold")
            line.append(check.fix)
            if instead is not None:
                line.append(f" (not needed here, where {PART_TITLES[instead]} will do)")
        grid.add_row(Text(str(check.status), style=_STYLES[check.status]), line)
    rows.append(grid)
    return Group(*rows)
