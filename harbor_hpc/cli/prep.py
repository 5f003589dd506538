"""`harbor-hpc build`, `rewrite`, `setup-sh`: preparing tasks' images and files."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from harbor_hpc.cli.app import (
    AccountOption,
    CacheDirOption,
    DryRunOption,
    JobsOption,
    JsonOption,
    ManifestOption,
    PartitionOption,
    QosOption,
    VerboseOption,
    app,
    info,
    manifest_path,
    progress,
    render,
    setup,
    stdout,
    unit_job_options,
    warn,
)
from harbor_hpc.core.config import Config
from harbor_hpc.core.config import cache_dir as default_store
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.images.build import (
    BuilderKind,
    BuildPreview,
    BuildResult,
    ImageOutcome,
    PlannedImage,
    choose_builder,
    parse_build_args,
    plan_build,
    run_build,
)

if TYPE_CHECKING:  # what a step needs loads when it runs: `--help` stays quick
    from harbor_hpc.images.build import Builder
    from harbor_hpc.images.setup_sh import SetupResult
    from harbor_hpc.slurm.convert import ConversionArray
    from harbor_hpc.tasks.discovery import TaskProblem
    from harbor_hpc.tasks.rewrite import RewriteResult

TasksArgument = Annotated[
    Path,
    typer.Argument(
        help="Folder holding the tasks: every folder below it with task.toml is one.",
        show_default=False,
    ),
]
BuildArgOption = Annotated[
    list[str] | None,
    typer.Option(
        "--build-arg",
        metavar="NAME=VALUE",
        help="A value for the Dockerfiles' ARG NAME (repeatable), passed to every build as "
        "`docker build --build-arg` does. Those a Dockerfile declares are part of its image's "
        "content hash: other values, another image. Added to config build_args (a list of "
        '"NAME=VALUE"); a flag wins for its NAME.',
    ),
]
_LISTED = 20


def _build_args(config: Config, flags: list[str] | None) -> dict[str, str]:
    """The config file's build args, then the flags' (a later NAME wins)."""
    return parse_build_args([*config.pick("build_args", None, []), *(flags or [])])


@app.command(
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
    "A task whose verifier runs in a container of its own (\\[verifier] environment_mode = "
    '"separate") with a tests/Dockerfile gets a second image from tests/, by the same rules. '
    "A task whose docker-compose file asks for what cannot run here is warned about, naming it; "
    "its services' build: contexts are built into the .sif store when a trial first starts them. "
    "A rerun builds only what the registry (or the store) does not already hold.\n\n"
    "Exits 1 naming the tasks whose image failed; the other images are still built.\n\n"
    "Example: harbor-hpc build tasks/ --registry localhost:5000/lab --manifest "
    "manifest.json"
)
def build(
    tasks_dir: TasksArgument,
    registry: Annotated[
        str | None,
        typer.Option(
            "--registry",
            help="REGISTRY/NAMESPACE to push to, e.g. registry.example.org/myteam; credentials "
            "come from your `docker login`. Docker builds only. \\[default: config registry]",
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
            "(a local disk with room for the unpacked image). \\[default: $APPTAINER_TMPDIR, "
            "else $TMPDIR, else /tmp]",
        ),
    ] = None,
    nohttps: Annotated[
        bool,
        typer.Option(
            "--nohttps",
            help="Reach the registry over plain HTTP (the Docker builder's pushes, the Apptainer "
            "builder's FROM images). Off unless given, set in the config (nohttps) or by "
            "APPTAINER_NOHTTPS=1.",
        ),
    ] = False,
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
    time_min: Annotated[
        int | None,
        typer.Option(
            "--time", min=1, help="Minutes per context (Slurm time limit). \\[default: 60]"
        ),
    ] = None,
    dry_run: DryRunOption = False,
    json_output: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Build one image per distinct build context and pin every task to it."""
    config = setup(verbose)
    if slurm and builder is BuilderKind.DOCKER:
        raise InputError(
            "--slurm builds with Apptainer on compute nodes, which have no Docker",
            hint="build with --builder apptainer --slurm, or with Docker here without --slurm",
        )
    chosen, why = (
        (BuilderKind.APPTAINER, "--slurm: compute nodes build with Apptainer")
        if slurm
        else choose_builder(builder)
    )
    if builder is BuilderKind.AUTO:
        info(f"builder: {chosen} ({why})")
    target = None
    if chosen is BuilderKind.DOCKER:
        target = config.pick("registry", registry, "")
        if not target:
            raise InputError(
                "no registry given",
                hint="pass --registry REGISTRY/NAMESPACE, or build into the .sif store without "
                "Docker: --builder apptainer",
            )
    elif registry or no_push:
        warn("--registry and --no-push are for Docker builds; the Apptainer builder ignores them")
    manifest_file = manifest_path(manifest)
    workers = config.pick("jobs", jobs, 2)
    plan = plan_build(tasks_dir, target, jobs=workers, build_args=_build_args(config, build_arg))
    _warn_compose(plan.compose)  # on stderr: --json output stays clean
    from harbor_hpc.apptainer.builder import ApptainerBuilder
    from harbor_hpc.images.docker_builder import DockerBuilder
    from harbor_hpc.slurm.build import SlurmBuilder, build_on_slurm
    from harbor_hpc.tasks.manifest import load_manifest

    if dry_run:
        recorded = load_manifest(manifest_file) if manifest_file.exists() else None
        render(BuildPreview(plan, recorded), json=json_output, show=_show_plan)
        return
    plain_http = True if nohttps else config.pick("nohttps", None, None)
    backend: Builder
    if chosen is BuilderKind.DOCKER:
        backend = DockerBuilder(plan, push=not no_push, nohttps=bool(plain_http))
    else:
        scratch = scratch_dir or config.pick("scratch_dir", None, None)
        store, scratch_path = default_store(cache_dir, config), Path(scratch) if scratch else None
        if slurm:

            def submitted(array: ConversionArray) -> None:
                info(
                    f"Slurm array job {array.job}: {array.images} context(s), logs in "
                    f"{array.log_dir}"
                )

            options = unit_job_options(config, partition, account, qos, time_min)
            backend = SlurmBuilder(
                store,
                manifest_file,
                options,
                build_args=plan.build_args,
                nohttps=plain_http,
                scratch=scratch_path,
                on_submitted=submitted,
            )
        else:
            backend = ApptainerBuilder(
                store, build_args=plan.build_args, nohttps=plain_http, scratch=scratch_path
            )
    with progress() as bar:
        overall = bar.add_task("images", total=len(plan.images), current="")

        def on_progress(image: PlannedImage, text: str) -> None:
            bar.update(overall, current=f"{image.name}: {text}")

        def on_done(outcome: ImageOutcome) -> None:
            bar.advance(overall)

        if isinstance(backend, SlurmBuilder):
            result = build_on_slurm(
                plan, manifest_file, backend, on_progress=on_progress, on_done=on_done
            )
        else:
            result = run_build(
                plan,
                manifest_file,
                backend,
                jobs=workers,
                on_progress=on_progress,
                on_done=on_done,
            )
    render(result, json=json_output, show=_show_build)
    if result.failed_tasks or result.problems:
        names = ", ".join(result.failed_tasks[:_LISTED])
        more = len(result.failed_tasks) - _LISTED
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
            hint=f"the errors are in {manifest_file}; fix them and run again (finished images are "
            "kept)",
        )


def _warn_compose(compose: dict[str, str]) -> None:
    for task, problem in sorted(compose.items()):
        warn(f"{task}: {problem}; its trials fail with class `unsupported`")


def _show_problems(problems: list[TaskProblem]) -> None:
    for problem in problems[:_LISTED]:
        warn(str(problem))
    if len(problems) > _LISTED:
        warn(f"... and {len(problems) - _LISTED} more")


def _show_plan(preview: BuildPreview) -> None:
    plan = preview.plan
    table = Table(title=f"{plan.task_count} tasks, {len(plan.images)} distinct build contexts")
    for column in ("image", "tasks", "example task", "status"):
        table.add_column(column)
    for key, image in plan.images.items():
        status = plan.status(key, preview.recorded)
        table.add_row(image.tagged, _uses(image), escape(image.users[0]), status)
    stdout.print(table)
    _warn_task_errors(plan.task_errors, plan.verifier_errors)
    _show_problems(plan.problems)


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
    table = Table(title=f"images -> {result.manifest}")
    for column in ("image", "tasks", "result"):
        table.add_column(column)
    for outcome in result.outcomes:
        shown = outcome.record.reference or outcome.record.sif or outcome.image.tagged
        text = escape(outcome.record.error or outcome.action)  # Docker's output is not markup
        style = "red" if outcome.failed else ""
        table.add_row(shown, _uses(outcome.image), f"[{style}]{text}[/]" if style else text)
    stdout.print(table)
    _warn_task_errors(result.task_errors, result.verifier_errors)
    _show_problems(result.problems)


@app.command(
    help="Set \\[environment].docker_image of every task to its pinned image from the manifest, "
    "and \\[verifier.environment].docker_image of a task whose verifier has an image of its own."
    "\n\nOnly that value changes; every other byte of task.toml stays. Tasks whose image failed, "
    "is not built, or (with --sif) has no .sif yet are left untouched and listed; task.toml "
    "files that do not parse are named. Exits 1 when any task was left out. Safe to run again."
    "\n\nExample: harbor-hpc rewrite tasks/ --manifest manifest.json --sif"
)
def rewrite(
    tasks_dir: TasksArgument,
    manifest: ManifestOption = None,
    sif: Annotated[
        bool,
        typer.Option(
            "--sif",
            help="Point docker_image at each image's .sif that `harbor-hpc convert` recorded, "
            "instead of the registry reference.",
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
    for task, reason in list(result.skipped.items())[:_LISTED]:
        warn(f"{task}: left untouched: {reason}")
    if len(result.skipped) > _LISTED:
        warn(f"... and {len(result.skipped) - _LISTED} more left untouched")
    _show_problems(result.problems)


@app.command(
    "setup-sh",
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
            "\\[default: config wheels_dir]",
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
    from harbor_hpc.images.setup_sh import write_setup_scripts

    config = setup(verbose)
    wheels_dir = config.pick("wheels_dir", str(wheels) if wheels else None, "")
    result = write_setup_scripts(
        tasks_dir,
        force=force,
        wheels=Path(wheels_dir) if wheels_dir else None,
        replay_copy=replay_copy,
        build_args=_build_args(config, build_arg),
        dry_run=dry_run,
    )
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
    _show_problems(result.problems)
