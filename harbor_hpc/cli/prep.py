"""`harbor-hpc rewrite` and `setup-sh`: pointing tasks at their images, writing their files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from harbor_hpc.cli.app import (
    LISTED,
    BuildArgOption,
    DryRunOption,
    JsonOption,
    ManifestOption,
    TasksArgument,
    VerboseOption,
    app,
    info,
    manifest_path,
    render,
    setup,
    show_problems,
    stdout,
    warn,
)
from harbor_hpc.core.config import configured
from harbor_hpc.core.errors import HarborHpcError

if TYPE_CHECKING:  # what a step needs loads when it runs: `--help` stays quick
    from harbor_hpc.images.setup_sh import SetupResult
    from harbor_hpc.tasks.rewrite import RewriteResult


@app.command(
    short_help="Point every task.toml at its pinned image or .sif.",
    help="Set [environment].docker_image of every task to its pinned image from the manifest, "
    "and [verifier.environment].docker_image of a task whose verifier has an image of its own."
    "\n\nOnly that value changes; every other byte of task.toml stays. Tasks whose image failed, "
    "is not built, or (with --sif) has no .sif yet are left untouched and listed; task.toml "
    "files that do not parse are named. Exits 1 when any task was left out. Safe to run again."
    "\n\nExample: harbor-hpc rewrite tasks/ --manifest manifest.json --sif",
)
def rewrite(
    tasks_dir: TasksArgument,
    manifest: ManifestOption = None,
    sif: Annotated[
        bool,
        typer.Option(
            "--sif",
            help="Point docker_image at each image's .sif in the manifest (recorded by "
            "`build --builder apptainer` or by `convert`), instead of the registry reference.",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print a unified diff of each change; write nothing.")
    ] = False,
    json_output: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Set [environment].docker_image of every task to its pinned image from the manifest."""
    from harbor_hpc.tasks.rewrite import rewrite_tasks

    setup(verbose)
    manifest_file = manifest_path(manifest)
    result = rewrite_tasks(tasks_dir, manifest_file, sif=sif, dry_run=dry_run)
    render(result, json=json_output, show=_show_rewrite)
    if not result.ok:
        parts = (
            (f"{len(result.skipped)} task(s) left untouched", result.skipped),
            (f"{len(result.problems)} task(s) not readable", result.problems),
        )
        raise HarborHpcError(
            "; ".join(part for part, count in parts if count),
            hint="build (or convert) what is missing, fix the named files, and run again",
        )


def _show_rewrite(result: RewriteResult) -> None:
    for task in result.changed if result.dry_run else []:
        stdout.print(result.diffs[task], end="", highlight=False, markup=False)
    verb = "would point" if result.dry_run else "pointed"
    info(
        f"{verb} {len(result.changed)} task(s) at their images; "
        f"{len(result.unchanged)} already pointed there"
    )
    for task, reason in list(result.skipped.items())[:LISTED]:
        warn(f"{task}: left untouched: {reason}")
    if len(result.skipped) > LISTED:
        warn(f"... and {len(result.skipped) - LISTED} more left untouched")
    show_problems(result.problems)


@app.command(
    "setup-sh",
    short_help="Write environment/files/setup.sh where a task has none.",
    help="Write environment/files/setup.sh into every task that has none.\n\n"
    "The script runs before the agent in Harbor's and NeMo Gym's Singularity flows: it makes the "
    "exec server's uvicorn and fastapi importable (doing nothing when they already are) and, "
    "with --replay-copy, copies in what the Dockerfile would have. It is valid bash and safe to "
    "run again. Existing setup.sh files are kept unless --force.\n\n"
    "Example: harbor-hpc setup-sh tasks/ --replay-copy",
)
def setup_sh(
    tasks_dir: TasksArgument,
    force: Annotated[
        bool, typer.Option("--force", help="Replace setup.sh files that already exist.")
    ] = False,
    wheels: Annotated[
        Path | None,
        typer.Option(
            "--wheels",
            help="Folder of wheels for uvicorn, fastapi and their dependencies, for offline "
            "compute nodes; staged into each task's environment/files/wheels (hard links when "
            "possible). Without it, setup.sh installs from the package index. "
            "[default: config wheels_dir]",
        ),
    ] = None,
    replay_copy: Annotated[
        bool,
        typer.Option(
            "--replay-copy",
            help="Also repeat the Dockerfile's COPY/ADD of local files in setup.sh (sources "
            "staged into environment/files/_replay), so the task runs on a shared base image.",
        ),
    ] = False,
    build_arg: BuildArgOption = None,
    dry_run: DryRunOption = False,
    json_output: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Write environment/files/setup.sh into every task that has none."""
    from harbor_hpc.images.setup_sh import SetupRequest, write_setup_scripts

    config = setup(verbose)
    request = configured(
        SetupRequest,
        config,
        tasks_dir=tasks_dir,
        force=force,
        wheels_dir=wheels,
        replay_copy=replay_copy,
        build_args=build_arg,
        dry_run=dry_run,
    )
    result = write_setup_scripts(request)
    render(result, json=json_output, show=_show_setup)
    if result.problems:
        raise HarborHpcError(
            f"{len(result.problems)} task(s) got no setup.sh",
            hint="fix the named files (or run without --replay-copy), then run again",
        )


def _show_setup(result: SetupResult) -> None:
    verb = "would write" if result.dry_run else "wrote"
    info(f"{verb} setup.sh in {len(result.written)} task(s); kept {len(result.kept)} existing")
    if result.kept:
        info("existing setup.sh files are kept; --force replaces them")
    show_problems(result.problems)
