"""`harbor-hpc convert`: every image of a manifest into the shared .sif store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

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
    console,
    info,
    manifest_path,
    print_json,
    progress,
    setup,
    stdout,
)
from harbor_hpc.core.config import cache_dir as default_store
from harbor_hpc.core.errors import InputError
from harbor_hpc.slurm.convert import (
    ImageConversion,
    SlurmOptions,
    SourceKind,
    plan_conversions,
    run_conversions,
)

SOURCES: tuple[SourceKind, ...] = ("registry", "docker-daemon")


@app.command()
def convert(
    manifest: ManifestOption = None,
    cache_dir: CacheDirOption = None,
    jobs: JobsOption = None,
    nohttps: Annotated[
        bool,
        typer.Option(
            "--nohttps",
            help="Reach the registry over plain HTTP (a loopback or lab registry). Off unless "
            "given, set in the config (nohttps) or by APPTAINER_NOHTTPS=1.",
        ),
    ] = False,
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
    time_min: Annotated[
        int | None,
        typer.Option("--time", min=1, help="Minutes per image (Slurm time limit). \\[default: 60]"),
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

    Exits 1 when any image failed (each one named with the tasks it serves); the rest are done.

    Example: harbor-hpc convert --manifest manifest.json --cache-dir /scratch/$USER/sif --slurm
    """
    config = setup(verbose)
    manifest_file = manifest_path(manifest)
    if source not in SOURCES:
        raise InputError(f"--source {source!r} is not one of: {', '.join(SOURCES)}")
    if slurm and source == "docker-daemon":
        raise InputError(
            "--source docker-daemon reads this machine's Docker, which compute nodes lack",
            hint="push the images (`harbor-hpc build`) and convert from the registry with --slurm",
        )
    store = default_store(cache_dir, config)
    use_http = True if nohttps else config.pick("nohttps", None, None)
    kind: SourceKind = "docker-daemon" if source == "docker-daemon" else "registry"
    planned = plan_conversions(manifest_file, store, source=kind, nohttps=use_http, force=force)
    if not dry_run:
        slurm_options = None
        log_dir = store.expanduser().absolute() / ".slurm"
        if slurm:
            slurm_options = SlurmOptions(
                log_dir=log_dir,
                partition=config.pick("partition", partition, None),
                account=config.pick("account", account, None),
                qos=config.pick("qos", qos, None),
                # Not the config's time_min: that one sizes trials, not conversions.
                time_min=time_min or 60,
                array_parallelism=config.pick("array_parallelism", None, None),
            )
        todo = sum(c.state == "to convert" for c in planned)
        with progress() as bar:
            task = bar.add_task("converting", total=todo, current="")
            run_conversions(
                manifest_file,
                planned,
                store,
                jobs=config.pick("jobs", jobs, 2),
                nohttps=use_http,
                force=force,
                slurm=slurm_options,
                on_done=lambda c: bar.update(task, advance=1, current=c.image),
                on_submitted=lambda job: info(
                    f"Slurm array job {job}: {todo} image(s), logs in {log_dir}"
                ),
            )
    _report(planned, store, json=json, dry_run=dry_run)
    if any(c.state == "failed" for c in planned):
        raise typer.Exit(1)


def _report(planned: list[ImageConversion], store: Path, *, json: bool, dry_run: bool) -> None:
    counts = {state: sum(c.state == state for c in planned) for state in _STATES}
    if json:
        print_json(
            {
                "cache_dir": str(store),
                "dry_run": dry_run,
                **{state.replace(" ", "_"): count for state, count in counts.items()},
                "images": [c.to_json() for c in planned],
            }
        )
        return
    for conversion in planned:
        if conversion.state == "failed":
            console.print(
                # Apptainer's output and task names are text, not markup (see `warn`).
                f"[red bold]failed:[/] {conversion.image} (tasks: "
                f"{escape(conversion.tasks_text())}): {escape(conversion.error or '')}",
                highlight=False,
            )
            if conversion.hint:
                console.print(f"  [dim]hint:[/] {escape(conversion.hint)}", highlight=False)
        elif dry_run and conversion.state == "to convert":
            stdout.print(f"would convert {conversion.image} -> {conversion.sif}", highlight=False)
    summary = ", ".join(f"{count} {state}" for state, count in counts.items() if count)
    stdout.print(f"{summary or 'no images'} (store: {store})", highlight=False)


_STATES = ("converted", "cached", "to convert", "failed")
