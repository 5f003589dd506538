"""`harbor-hpc build`: one image per distinct build context, with Docker or Apptainer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from harbor_hpc.cli.app import (
    LISTED,
    AccountOption,
    BuildArgOption,
    CacheDirOption,
    DryRunOption,
    JobsOption,
    JsonOption,
    ManifestOption,
    NoHttpsOption,
    PartitionOption,
    QosOption,
    SbatchArgOption,
    SetupOption,
    TasksArgument,
    VerboseOption,
    app,
    console,
    info,
    placement,
    progress,
    render,
    setup,
    show_problems,
    stdout,
    warn,
)
from harbor_hpc.core.config import configured
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.images.engine import BuilderKind

if TYPE_CHECKING:  # what a step needs loads when it runs: `--help` stays quick
    from harbor_hpc.images.build import BuildPreview, BuildResult, ImageOutcome, PlannedImage
    from harbor_hpc.slurm.cluster import UnitArray


@app.command(
    short_help="Build one image per distinct build context.",
    help="Build one image per distinct build context and pin every task to it.\n\n"
    "Tasks whose environment/ folders are identical (the Dockerfile and every file Docker would "
    "send, .dockerignore honoured) share one image named from that content. With Docker "
    "(--builder docker) each image is pushed as REGISTRY/NAMESPACE/env-<hash> and the manifest "
    "maps each task to REGISTRY/NAMESPACE/NAME@sha256:...; with Apptainer (--builder "
    "apptainer, no Docker or registry needed, as an ordinary user) each image is built from its "
    "Dockerfile straight into the .sif store (--cache-dir) as env-<hash>.sif and the manifest "
    "records the .sif and its sha256 for `rewrite --sif`; with --slurm those builds run on "
    "compute nodes, one Slurm array element per context. --builder auto (the default) takes "
    "Docker where an engine answers, else Apptainer, and says which. The manifest is updated as "
    "each image finishes, or maps the task to its error. "
    "A task whose verifier runs in a container of its own ([verifier] environment_mode = "
    '"separate") with a tests/Dockerfile gets a second image from tests/, by the same rules. '
    "A task whose docker-compose file asks for what cannot run here is warned about, naming it; "
    "its services' build: contexts are built into the .sif store when a trial first starts them. "
    "A rerun builds only what the registry (or the store) does not already hold.\n\n"
    "Exits 1 naming the tasks whose image failed; the other images are still built.\n\n"
    "Example: harbor-hpc build tasks/ --registry localhost:5000/lab \\\n"
    "             --manifest manifest.json",
)
def build(
    tasks_dir: TasksArgument,
    registry: Annotated[
        str | None,
        typer.Option(
            "--registry",
            help="REGISTRY/NAMESPACE to push to, e.g. registry.example.org/myteam; credentials "
            "come from your `docker login`. Docker builds only. [default: config registry]",
        ),
    ] = None,
    manifest: ManifestOption = None,
    builder: Annotated[
        BuilderKind,
        typer.Option(
            "--builder",
            help="docker: a Docker Engine builds and pushes. apptainer: `apptainer build "
            "--fakeroot` builds into the .sif store, here, without Docker. auto: Docker when an "
            "engine answers, else Apptainer.",
        ),
    ] = BuilderKind.AUTO,
    cache_dir: CacheDirOption = None,
    scratch_dir: Annotated[
        Path | None,
        typer.Option(
            "--scratch-dir",
            help="Apptainer builds: where each build unpacks its image and stages its files "
            "(a local disk with room for the unpacked image). [default: $APPTAINER_TMPDIR, "
            "else $TMPDIR, else /tmp]",
        ),
    ] = None,
    nohttps: NoHttpsOption = False,
    jobs: JobsOption = None,
    build_arg: BuildArgOption = None,
    no_push: Annotated[
        bool,
        typer.Option(
            "--no-push",
            help="Docker builds: build and tag locally only. The manifest then records each "
            "image's local id and tag but no pinned reference, so `rewrite` leaves those tasks "
            "alone until a build that pushes (which reuses the local images instead of building "
            "again).",
        ),
    ] = False,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Apptainer builds on compute nodes: one Slurm array job, one element per "
            "context not yet in the store; waits for it. The store and the manifest's folder "
            "must be on a filesystem the nodes share.",
        ),
    ] = False,
    partition: PartitionOption = None,
    account: AccountOption = None,
    qos: QosOption = None,
    sbatch_arg: SbatchArgOption = None,
    setup_line: SetupOption = None,
    time_min: Annotated[
        int | None,
        typer.Option("--time", min=1, help="Minutes per context (Slurm time limit). [default: 60]"),
    ] = None,
    mem_mb: Annotated[
        int | None,
        typer.Option("--mem", min=1, help="MB per context (Slurm memory). [default: 8192]"),
    ] = None,
    dry_run: DryRunOption = False,
    json_output: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Build one image per distinct build context and pin every task to it."""
    from harbor_hpc.steps import build as step

    config = setup(verbose)
    request = configured(
        step.BuildRequest,
        config,
        tasks_dir=tasks_dir,
        manifest=manifest,
        builder=builder,
        registry=registry,
        push=not no_push,
        cache_dir=cache_dir,
        scratch_dir=scratch_dir,
        nohttps=nohttps or None,
        jobs=jobs,
        build_args=build_arg,
        slurm=placement(config, partition, account, qos, time_min, sbatch_arg, setup_line)
        if slurm
        else None,
        mem_mb=mem_mb,
    )
    chosen, why = step.choose(request)
    docker_only = registry or no_push
    if builder is BuilderKind.AUTO:
        unused = "; --registry and --no-push are not used" if docker_only and not slurm else ""
        info(f"builder: {chosen} ({why}){unused if chosen is BuilderKind.APPTAINER else ''}")
    elif chosen is BuilderKind.APPTAINER and docker_only:
        warn("--registry and --no-push are for Docker builds; the Apptainer builder ignores them")
    planned = step.plan(request, chosen)
    plan = planned.plan
    _warn_compose(plan.compose)  # on stderr: --json output stays clean
    if dry_run:
        render(planned.preview(), json=json_output, show=_show_plan)
        if plan.problems:  # as the real build would
            raise HarborHpcError(
                f"{len(plan.problems)} folder(s) are not valid tasks",
                hint="fix the named files and run again",
            )
        return

    def submitted(array: UnitArray) -> None:
        info(f"Slurm array job {array.job}: {array.images} context(s), logs in {array.log_dir}")

    with progress() as bar:
        overall = bar.add_task("images", total=len(plan.images), current="")

        def on_progress(image: PlannedImage, text: str) -> None:
            bar.update(overall, current=f"{image.name}: {text}")

        def on_done(outcome: ImageOutcome) -> None:
            bar.advance(overall)
            if not console.is_terminal:  # a log gets a line as each image ends, not a bar
                ended = int(bar.tasks[0].completed)
                result = "failed" if outcome.failed else outcome.action
                info(f"{ended}/{len(plan.images)} {outcome.image.name}: {result}")

        result = step.run(planned, on_progress=on_progress, on_done=on_done, on_submitted=submitted)
    render(result, json=json_output, show=_show_build)
    if result.failed_tasks or result.problems:
        names = ", ".join(result.failed_tasks[:LISTED])
        more = len(result.failed_tasks) - LISTED
        failed = f"{len(result.failed_tasks)} task(s) have no image: {names}" + (
            f" and {more} more" if more > 0 else ""
        )
        invalid = f"{len(result.problems)} folder(s) are not valid tasks"
        raise HarborHpcError(
            "; ".join(
                part
                for part, count in ((failed, result.failed_tasks), (invalid, result.problems))
                if count
            ),
            hint=f"the errors are in {request.manifest}; fix them and run again (finished "
            "images are kept)",
        )


def _warn_compose(compose: dict[str, str]) -> None:
    for task, problem in sorted(compose.items()):
        warn(f"{task}: {problem}; its trials fail with class `unsupported`")


def _show_plan(preview: BuildPreview) -> None:
    plan = preview.plan
    where = f" for {plan.registry}" if str(plan.registry) else ""
    table = Table(
        title=f"{plan.task_count} tasks, {len(plan.images)} distinct build contexts{where}"
    )
    for column in ("image", "tasks", "example task", "status"):
        table.add_column(column)
    for key, image in plan.images.items():
        status = plan.status(key, preview.recorded)
        table.add_row(image.name, _uses(image), escape(image.users[0]), status)
    stdout.print(table)
    _warn_task_errors(plan.task_errors, plan.verifier_errors)
    show_problems(plan.problems)


def _uses(image: PlannedImage) -> str:
    """How many tasks use an image, and as how many verifiers when any."""
    shown = str(len(image.tasks))
    return f"{shown} (+{len(image.verifier_tasks)} verifiers)" if image.verifier_tasks else shown


def _warn_task_errors(task_errors: dict[str, str], verifier_errors: dict[str, str]) -> None:
    for task, error in sorted(task_errors.items()):
        warn(f"{task}: {error}")
    for task, error in sorted(verifier_errors.items()):
        warn(f"{task}: verifier image: {error}")


def _show_build(result: BuildResult) -> None:
    # Names only: full references and .sif paths are in the manifest, and cut at 80 columns.
    table = Table(title=f"images, recorded in {result.manifest}")
    for column in ("image", "tasks", "result"):
        table.add_column(column)
    for outcome in result.outcomes:
        text = escape(outcome.record.error or outcome.action)  # Docker's output is not markup
        style = "red" if outcome.failed else ""
        table.add_row(
            outcome.image.name, _uses(outcome.image), f"[{style}]{text}[/]" if style else text
        )
    stdout.print(table)
    _warn_task_errors(result.task_errors, result.verifier_errors)
    show_problems(result.problems)
