"""`harbor-hpc fetch`: a Hugging Face task dataset, only the part asked for, as task folders; or
a dataset of Harbor's registry, downloaded by Harbor's own client."""

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
from harbor_hpc.core.errors import InputError, ReportedFailure

if TYPE_CHECKING:
    from harbor_hpc.fetch import FetchPlan, FetchReport, RegistryPlan, RegistryReport


@app.command(
    name="fetch",
    short_help="Download the tasks you ask for from Hugging Face or Harbor's registry.",
)
def fetch_command(
    dataset: Annotated[
        str,
        typer.Argument(
            metavar="DATASET",
            help="A Hugging Face dataset repository, ORG/NAME (e.g. "
            "nvidia/Nemotron-Terminal-Synthetic-Tasks); or a Harbor registry dataset, "
            "NAME@VERSION (e.g. terminal-bench@2.0) or ORG/NAME@REF: a name with '@', or any "
            "name with --registry or --repo, is Harbor's.",
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
            "'skill_based/mixed/*.tar.gz' or 'skill_based/mixed/'; for a Harbor dataset, only "
            "the tasks whose name matches it (as harbor run -i), e.g. 'hello-*'. "
            "Default: all.",
        ),
    ] = None,
    revision: Annotated[
        str | None,
        typer.Option(
            "--revision",
            "-r",
            help="Branch, tag or commit of a Hugging Face dataset. [default: main]",
        ),
    ] = None,
    registry: Annotated[
        str | None,
        typer.Option(
            "--registry",
            help="The Harbor registry.json to look DATASET up in: a path, or an http(s) URL; "
            "with --repo, its path in that repository. [default: Harbor's own registry]",
        ),
    ] = None,
    repo: Annotated[
        str | None,
        typer.Option(
            "--repo",
            help="A git registry to look DATASET up in, as harbor run --repo takes it: a git "
            "URL (https://, ssh://, git://), optionally @REF; its registry.json lists the "
            "datasets.",
        ),
    ] = None,
    dry_run: DryRunOption = False,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Download a task dataset from Hugging Face or Harbor's registry (only what --include asks
    for) into DEST.

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

    A Harbor registry dataset is resolved and downloaded by Harbor itself, as harbor run -d
    would: each task lands in DEST/<task name>, all of them or none (a failure leaves DEST as it
    was). A rerun leaves tasks whose content did not change as they are and replaces those that
    changed; a folder it did not place is never replaced.

    Example: harbor-hpc fetch nvidia/Nemotron-Terminal-Synthetic-Tasks \\
        --dest tasks --include 'skill_based/mixed/scientific_computing.tar.gz'

    Example: harbor-hpc fetch terminal-bench@2.0 --dest tasks-tb --include 'fix-*'
    """
    from harbor_hpc.fetch import fetch, plan_fetch  # the hub client loads when a fetch runs

    setup(verbose)
    patterns = include or []
    if registry is not None or repo is not None or "@" in dataset:
        if revision is not None:
            raise InputError(
                f"{dataset}: --revision is for Hugging Face datasets",
                hint="a Harbor dataset's version follows its name: NAME@VERSION",
            )
        _fetch_registry(dataset, dest, patterns, registry, repo, dry_run=dry_run, json=json)
        return
    if dry_run:
        plan = plan_fetch(dataset, dest, include=patterns, revision=revision)
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
        report = fetch(dataset, dest, include=patterns, revision=revision, on_archive=on_archive)
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


def _fetch_registry(
    dataset: str,
    dest: Path,
    include: list[str],
    registry: str | None,
    repo: str | None,
    *,
    dry_run: bool,
    json: bool,
) -> None:
    from harbor_hpc.fetch import fetch_registry_dataset, plan_registry_dataset

    if dry_run:
        plan = plan_registry_dataset(dataset, dest, registry=registry, repo=repo, include=include)
        render(plan, json=json, show=_show_registry_plan)
        return
    bar = progress()
    task = bar.add_task("downloading", total=None, current="")

    def on_task(done: int, total: int, name: str) -> None:
        bar.update(task, completed=done, total=total, current=name)

    with bar:
        report = fetch_registry_dataset(
            dataset, dest, registry=registry, repo=repo, include=include, on_task=on_task
        )
    _show_failures(report)
    render(report, json=json, show=_show_registry_report)
    if report.failed:
        raise ReportedFailure


def _show_registry_plan(plan: RegistryPlan) -> None:
    for task in plan.tasks:
        stdout.print(
            f"{escape(task.name)} ({escape(task.source)}): {escape(task.action)}", highlight=False
        )
    stdout.print(
        f"dry run, nothing written: {len(plan.tasks)} tasks for {plan.dest}", highlight=False
    )


def _show_registry_report(report: RegistryReport) -> None:
    table = Table(title=f"{escape(report.dataset)} under {escape(str(report.dest))}")
    table.add_column("task")
    table.add_column("from")
    for name, source in report.sources.items():
        table.add_row(escape(name), escape(source))
    stdout.print(table)
    stdout.print(
        f"{escape(report.dataset)}: {_tasks(len(report.placed))} placed, "
        f"{len(report.unchanged)} unchanged, {len(report.failed)} refused; "
        f"{_tasks(len(report.tasks))} under {report.dest}",
        highlight=False,
    )


def _tasks(count: int) -> str:
    return f"{count} task" if count == 1 else f"{count} tasks"


def _show_failures(report: FetchReport | RegistryReport) -> None:
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
