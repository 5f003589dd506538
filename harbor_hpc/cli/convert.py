"""`harbor-hpc convert`: every image of a manifest into the shared .sif store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from harbor_hpc.cli.app import (
    AccountOption,
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
    VerboseOption,
    app,
    console,
    info,
    placement,
    progress,
    render,
    setup,
    stdout,
)
from harbor_hpc.core.config import configured
from harbor_hpc.core.errors import ReportedFailure

if TYPE_CHECKING:  # the conversion machinery loads when a conversion runs
    from harbor_hpc.slurm.cluster import UnitArray
    from harbor_hpc.steps.convert import ConvertReport


@app.command(short_help="Turn every image of a manifest into a .sif in the store.")
def convert(
    manifest: ManifestOption = None,
    cache_dir: CacheDirOption = None,
    jobs: JobsOption = None,
    nohttps: NoHttpsOption = False,
    source: Annotated[
        str,
        typer.Option(
            "--source",
            help="registry: pull each image by its digest. docker-daemon: build from this "
            "machine's Docker by the image's tag (for images built here and not pushed).",
        ),
    ] = "registry",
    force: Annotated[
        bool, typer.Option("--force", help="Convert again even images already in the store.")
    ] = False,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Hash every .sif already in the store and compare it with the sha256 recorded "
            "when it was converted; convert again those that differ.",
        ),
    ] = False,
    slurm: Annotated[
        bool,
        typer.Option(
            "--slurm",
            help="Convert on compute nodes: one Slurm array job, one element per image not yet "
            "in the store; waits for it.",
        ),
    ] = False,
    partition: PartitionOption = None,
    account: AccountOption = None,
    qos: QosOption = None,
    sbatch_arg: SbatchArgOption = None,
    setup_line: SetupOption = None,
    time_min: Annotated[
        int | None,
        typer.Option("--time", min=1, help="Minutes per image (Slurm time limit). [default: 60]"),
    ] = None,
    mem_mb: Annotated[
        int | None,
        typer.Option("--mem", min=1, help="MB per image (Slurm memory). [default: 4096]"),
    ] = None,
    dry_run: DryRunOption = False,
    json: JsonOption = False,
    verbose: VerboseOption = 0,
) -> None:
    """Turn every image of a manifest into a checked .sif in the store, each image once.

    Files are named by image digest (sha256-<hex>.sif), so tasks, datasets and users that share an
    image share one file. Images already in the store are skipped in milliseconds; each new .sif
    is checked to run before it counts, and recorded in the manifest for `rewrite --sif`. Safe to
    run from many shells or nodes at once on one store. Registry logins come from
    APPTAINER_DOCKER_USERNAME and APPTAINER_DOCKER_PASSWORD.

    --verify hashes the images already in the store against the sha256 recorded when each was
    converted (jobs also use an image only after it matched, once per node) and converts a
    damaged one again.

    Exits 1 when any image failed (each one named with the tasks it serves); the rest are done.

    Example: harbor-hpc convert --manifest manifest.json --cache-dir sif --slurm
    """
    from harbor_hpc.steps.convert import ConvertRequest, convert_images, parse_source

    config = setup(verbose)
    request = configured(
        ConvertRequest,
        config,
        manifest=manifest,
        cache_dir=cache_dir,
        source=parse_source(source),
        nohttps=nohttps or None,
        force=force,
        verify=verify,
        jobs=jobs,
        slurm=placement(config, partition, account, qos, time_min, sbatch_arg, setup_line)
        if slurm
        else None,
        mem_mb=mem_mb,
        dry_run=dry_run,
    )
    with progress() as bar:
        # Shown once there is work: a dry run converts nothing.
        task = bar.add_task("converting", total=None, current="", visible=False)

        def submitted(array: UnitArray) -> None:
            info(f"Slurm array job {array.job}: {array.images} image(s), logs in {array.log_dir}")

        report = convert_images(
            request,
            on_planned=lambda todo: bar.update(task, total=todo, visible=True),
            on_done=lambda c: bar.update(task, advance=1, current=c.image),
            on_submitted=submitted,
        )
    render(report, json=json, show=_show)
    if report.failed:
        raise ReportedFailure


def _show(report: ConvertReport) -> None:
    from harbor_hpc.steps.convert import ConversionState

    for conversion in report.images:
        if conversion.state is ConversionState.FAILED:
            console.print(
                # Apptainer's output and task names are text, not markup (see `warn`).
                f"[red bold]failed:[/] {conversion.image} (tasks: "
                f"{escape(conversion.tasks_text())}): {escape(conversion.error or '')}",
                highlight=False,
                soft_wrap=True,  # one line however long: logs and scripts read it
            )
            if conversion.hint:
                console.print(
                    f"  [dim]hint:[/] {escape(conversion.hint)}", highlight=False, soft_wrap=True
                )
        elif report.dry_run and conversion.state is ConversionState.TO_CONVERT:
            stdout.print(f"would convert {conversion.image} -> {conversion.sif}", highlight=False)
        if conversion.damaged:
            done = "would convert" if report.dry_run else "converted"
            console.print(
                f"[yellow bold]damaged:[/] {conversion.sif} did not match the sha256 recorded "
                f"when it was converted; {done} again",
                highlight=False,
            )
    counts = report.counts.items()
    summary = ", ".join(f"{count} {state}" for state, count in counts if count)
    damaged = sum(c.damaged for c in report.images)
    checked = f", {damaged} damaged" if report.verified else ""
    stdout.print(f"{summary or 'no images'}{checked} (store: {report.store})", highlight=False)
