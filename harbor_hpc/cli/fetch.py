"""`harbor-hpc fetch`: a Hugging Face task dataset, only the part asked for, as task folders."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.filesize import decimal
from rich.markup import escape
from rich.table import Table

from harbor_hpc.cli.app import (
    DryRunOption,
    JsonOption,
    VerboseOption,
    app,
    console,
    progress,
    render,
    setup,
    stdout,
)
from harbor_hpc.core.errors import ReportedFailure

if TYPE_CHECKING:
    from harbor_hpc.fetch import FetchPlan, FetchReport


@app.command(name="fetch", short_help="Download the tasks you ask for from a Hugging Face dataset.")
def fetch_command(
    repo_id: Annotated[
        str,
        typer.Argument(
            metavar="REPO_ID",
            help="The dataset repository, ORG/NAME, e.g. nvidia/Nemotron-Terminal-Synthetic-Tasks.",
        ),
    ],
    dest: Annotated[
        Path,
        typer.Option("--dest", "-d", help="Folder the tasks land in (created if needed)."),
    ],
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            "-i",
            help="Fetch only repository files matching this glob (repeatable), e.g. "
            "'skill_based/mixed/*.tar.gz' or 'skill_based/mixed/'. Default: every file.",
        ),
    ] = None,
    revision: Annotated[
        str | None,
        typer.Option("--revision", "-r", help="Branch, tag or commit. [default: main]"),
    ] = None,
    dry_run: DryRunOption = False,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Download a task dataset from Hugging Face (only what --include asks for) into DEST.

    Archives (.tar, .tar.gz, .tgz, .zip) are unpacked into DEST at their own folder in the
    repository, as `tar -xzf ARCHIVE -C DEST/<folder>` would: skill_based/mixed/x.tar.gz
    holding x/ yields DEST/skill_based/mixed/x/. Other files are copied to their repository
    path. An archive with an unsafe member (absolute path, '..', a link out, a device) is
    refused whole and named; the others go on, and the exit code is 1. A rerun downloads nothing
    already in the Hugging Face cache and unpacks only archives whose content changed. It ends
    with the tasks found under DEST, per top folder.

    Hugging Face settings come from the environment: HF_TOKEN (private or gated datasets),
    HF_HOME or HF_HUB_CACHE (the download cache), HF_ENDPOINT (a mirror), HF_HUB_OFFLINE=1
    (work from the cache alone).

    Example: harbor-hpc fetch nvidia/Nemotron-Terminal-Synthetic-Tasks \\
        --dest tasks --include 'skill_based/mixed/scientific_computing.tar.gz'
    """
    from harbor_hpc.fetch import fetch, plan_fetch  # the hub client loads when a fetch runs

    setup(verbose)
    patterns = include or []
    if dry_run:
        plan = plan_fetch(repo_id, dest, include=patterns, revision=revision)
        render(plan, json=json, show=_show_plan)
        return
    # huggingface_hub draws its own download bars; ours appears once unpacking starts, so the
    # two never fight over the terminal.
    bar = progress()
    task = bar.add_task("unpacking", total=None, current="")

    def on_archive(done: int, total: int, path: str) -> None:
        if not bar.live.is_started:
            if console.is_terminal:
                console.line()  # huggingface_hub leaves its last bar's line open
            bar.start()
        bar.update(task, completed=done, total=total, current=path)

    try:
        report = fetch(repo_id, dest, include=patterns, revision=revision, on_archive=on_archive)
    finally:
        bar.stop()
    _show_failures(report)  # on stderr, with --json too
    render(report, json=json, show=_show_report)
    if report.failed:
        raise ReportedFailure


def _show_plan(plan: FetchPlan) -> None:
    for step in plan.steps:
        where = "cached" if step.cached else decimal(step.size or 0)
        stdout.print(f"{escape(step.path)} ({where}): {escape(step.action)}", highlight=False)
    stdout.print(
        f"dry run, nothing written: {len(plan.steps)} files for {plan.dest}", highlight=False
    )


def _show_failures(report: FetchReport) -> None:
    # escape(): member and file names come from strangers and may look like rich markup.
    for failure in report.failed:
        console.print(f"[red bold]error:[/] {escape(failure.message)}", highlight=False)
        if failure.hint:
            console.print(f"  [dim]hint:[/] {escape(failure.hint)}", highlight=False)
    for problem in report.task_problems:
        console.print(f"[yellow]warning:[/] {escape(problem)}", highlight=False)


def _show_report(report: FetchReport) -> None:
    table = Table(title=f"tasks under {escape(str(report.dest))}")
    table.add_column("folder")
    table.add_column("tasks", justify="right")
    for folder, count in report.tasks_by_folder().items():
        table.add_row(escape(folder), str(count))
    stdout.print(table)
    stdout.print(
        f"{escape(report.repo_id)}@{report.commit[:12]}: {len(report.unpacked)} archives unpacked, "
        f"{len(report.unchanged)} unchanged, {len(report.failed)} failed; "
        f"{len(report.files_placed)} files copied, {len(report.files_unchanged)} unchanged; "
        f"{len(report.tasks)} tasks",
        highlight=False,
    )
