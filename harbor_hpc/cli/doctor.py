"""`harbor-hpc doctor`: what this machine has for the cluster or the build role, and what to fix."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from harbor_hpc.cli.app import (
    CacheDirOption,
    JsonOption,
    VerboseOption,
    app,
    console,
    render,
    setup,
    stdout,
)
from harbor_hpc.core.errors import HarborHpcError, ReportedFailure
from harbor_hpc.steps.doctor import PART_TITLES, REQUIRED_PARTS, Report, Role, Status, run_doctor

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
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Check what this machine has for a role: each part probed for real, each gap with a fix.

    Exits 0 when the parts the role needs work, 1 otherwise.

    cluster: Apptainer runs a tiny image here (built once into the cache), Slurm answers.

    build: the Docker Engine answers (through DOCKER_HOST or the default socket), or Apptainer
    builds work for you (a real `apptainer build --fakeroot`, subuid ranges, scratch space).

    Example: harbor-hpc doctor --role all --cache-dir /scratch/$USER/sif --json
    """
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
