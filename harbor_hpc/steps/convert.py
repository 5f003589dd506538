"""Convert every image of a manifest into the .sif store: here, in parallel, or on Slurm nodes.

Every image means the tasks' own images, the images built for separate verifiers and compose
services, and the references task authors set in `[verifier.environment] docker_image` and in
their compose services' `image:` (recorded per task).

Images already in the store cost two `stat` calls each, so a rerun does only what is left; with
`verify`, each is hashed and compared with the sha256 recorded when it was converted, and one
that differs (damaged in place) is converted again. Each
finished image is written into the manifest (`ImageRecord.sif`) as soon as it is done, so an
interrupted run keeps what it finished. A failing image is reported with the tasks it serves and
the others go on.

With Slurm, the images not yet cached become one submitit array job, one element per image;
the elements convert through the same locked store, so a node never repeats another's work. The
submitting process waits, reading each element's result as it comes (`cluster.await_array`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from harbor_hpc.containers.store import ensure_sif, is_ready, resolve_nohttps, sif_path_for, verify
from harbor_hpc.core.config import default_cache_dir
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, JobRequest, SlurmPlacement, UnitArray, unit_log_dir
from harbor_hpc.tasks.manifest import (
    ImageRecord,
    Manifest,
    RoleImage,
    load_manifest,
    update_manifest,
)

log = logging.getLogger(__name__)


class Source(StrEnum):
    """Where images come from: the registry by digest, or this machine's Docker by tag."""

    REGISTRY = "registry"
    DOCKER_DAEMON = "docker-daemon"


class ConversionState(StrEnum):
    CONVERTED = "converted"
    CACHED = "cached"
    TO_CONVERT = "to convert"
    FAILED = "failed"


# mksquashfs is the slow part and uses every core it gets; memory stays modest.
SLURM_CPUS = 2
SLURM_MEM_MB = 4096


@dataclass
class ImageConversion:
    """One distinct image of the manifest: what it is, which tasks use it, how it went."""

    image: str  # as the user knows it: the pinned reference or the local tag
    source: str  # what the store converts (`docker-daemon://...` for local images)
    keys: list[str]  # manifest image entries that are this image
    tasks: list[str]
    # (task, compose service, or None for its verifier) whose author named this image (its
    # .sif is recorded per task).
    named_by: list[tuple[str, str | None]] = field(default_factory=list)
    sif: Path | None = None
    state: ConversionState = ConversionState.TO_CONVERT
    error: str | None = None
    hint: str | None = None
    seconds: float | None = None
    # In the store, but its content no longer matched its recorded sha256 (`--verify`).
    damaged: bool = False

    @property
    def ok(self) -> bool:
        return self.state in (ConversionState.CACHED, ConversionState.CONVERTED)

    def tasks_text(self, shown: int = 3) -> str:
        names = ", ".join(self.tasks[:shown]) or "no tasks"
        more = len(self.tasks) - shown
        return f"{names} and {more} more" if more > 0 else names

    def fail(self, error: str, hint: str | None = None) -> None:
        self.state, self.error, self.hint = ConversionState.FAILED, error, hint

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image,
            "source": self.source,
            "state": self.state,
            "sif": str(self.sif) if self.sif else None,
            "tasks": self.tasks,
            "error": self.error,
            "hint": self.hint,
            "damaged": self.damaged,
            "seconds": None if self.seconds is None else round(self.seconds, 1),
        }


def parse_source(text: str) -> Source:
    try:
        return Source(text)
    except ValueError:
        known = ", ".join(Source)
        raise InputError(f"--source {text!r} is not one of: {known}") from None


@dataclass(frozen=True)
class ConvertRequest:
    """One `convert`: the manifest's images into the store, here (`jobs` at a time) or, with
    `slurm`, on compute nodes where it says, one array element per image (`mem_mb` each)."""

    manifest: Path
    # The .sif store; None: the default one (`core.config.default_cache_dir`).
    cache_dir: Path | None = None
    source: Source = Source.REGISTRY
    # Plain HTTP to the registry; None leaves it to APPTAINER_NOHTTPS.
    nohttps: bool | None = None
    force: bool = False
    verify: bool = False
    jobs: int = 2
    slurm: SlurmPlacement | None = None
    mem_mb: int = SLURM_MEM_MB
    array_parallelism: int | None = None
    dry_run: bool = False
    # What harbor-hpc.toml may set (`core.config.configured`).
    CONFIGURED: ClassVar[tuple[str, ...]] = (
        "manifest",
        "cache_dir",
        "nohttps",
        "jobs",
        "array_parallelism",
    )

    @property
    def store(self) -> Path:
        return self.cache_dir or default_cache_dir()


@dataclass
class ConvertReport:
    """Every distinct image of the manifest and how it went (or would go, in a dry run)."""

    store: Path
    dry_run: bool
    images: list[ImageConversion]
    verified: bool = False

    @property
    def counts(self) -> dict[ConversionState, int]:
        return {state: sum(c.state is state for c in self.images) for state in ConversionState}

    @property
    def failed(self) -> bool:
        return any(c.state is ConversionState.FAILED for c in self.images)

    def to_json(self) -> dict[str, Any]:
        return {
            "cache_dir": str(self.store),
            "dry_run": self.dry_run,
            "verified": self.verified,
            "damaged": sum(c.damaged for c in self.images),
            **{state.replace(" ", "_"): count for state, count in self.counts.items()},
            "images": [c.to_json() for c in self.images],
        }


def convert_images(
    request: ConvertRequest,
    *,
    on_planned: Callable[[int], None] | None = None,
    on_done: Callable[[ImageConversion], None] | None = None,
    on_submitted: Callable[[UnitArray], None] | None = None,
) -> ConvertReport:
    """Plan the manifest's images and, unless a dry run, convert the ones not yet in the store.

    `on_planned` hears how many images are to be converted before the work starts; `on_done`
    and `on_submitted` as in `run_conversions`.
    """
    if request.slurm is not None and request.source is Source.DOCKER_DAEMON:
        raise InputError(
            "--source docker-daemon reads this machine's Docker, which compute nodes lack",
            hint="push the images (`harbor-hpc build`) and convert from the registry with --slurm",
        )
    planned = plan_conversions(
        request.manifest,
        request.store,
        source=request.source,
        nohttps=request.nohttps,
        force=request.force,
    )
    if request.verify:
        _verify_cached(planned, jobs=request.jobs)
    if not request.dry_run:
        if on_planned is not None:
            on_planned(sum(c.state is ConversionState.TO_CONVERT for c in planned))
        run_conversions(
            request.manifest,
            planned,
            request.store,
            jobs=request.jobs,
            nohttps=request.nohttps,
            force=request.force,
            slurm=None
            if request.slurm is None
            else cluster.unit_request(
                "harbor-hpc-convert",
                request.slurm,
                cpus=SLURM_CPUS,
                mem_mb=request.mem_mb,
                array_parallelism=request.array_parallelism,
            ),
            on_done=on_done,
            on_submitted=on_submitted,
        )
    return ConvertReport(request.store, request.dry_run, planned, verified=request.verify)


def _verify_cached(planned: list[ImageConversion], *, jobs: int) -> None:
    """Hash each cached .sif against its record, `jobs` at a time; a damaged one is to be
    converted again."""
    cached = [c for c in planned if c.state is ConversionState.CACHED and c.sif is not None]
    with ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="verify") as pool:
        for conversion, good in zip(
            cached, pool.map(lambda c: c.sif is not None and verify(c.sif), cached), strict=True
        ):
            if not good:
                conversion.state, conversion.damaged = ConversionState.TO_CONVERT, True


def plan_conversions(
    manifest_path: Path,
    cache_dir: Path,
    *,
    source: Source = Source.REGISTRY,
    nohttps: bool | None = None,
    force: bool = False,
) -> list[ImageConversion]:
    """The manifest's distinct images and whether each is cached; writes nothing.

    Images that cannot be converted at all (build failed, never pushed, not in the local Docker)
    come back already `failed`, naming why.
    """
    if not manifest_path.is_file():
        raise InputError(
            f"{manifest_path}: no such manifest", hint="make one with `harbor-hpc build`"
        )
    manifest = load_manifest(manifest_path)
    cache_dir = cache_dir.expanduser().absolute()
    by_sif: dict[Path, ImageConversion] = {}
    unusable: list[ImageConversion] = []
    candidates = [_conversion_for(rec, key, source) for key, rec in sorted(manifest.images.items())]
    for conversion in [*candidates, *_author_references(manifest)]:
        if conversion.state is ConversionState.FAILED:
            unusable.append(conversion)
            continue
        try:
            sif = sif_path_for(conversion.source, cache_dir, nohttps=nohttps)
        except HarborHpcError as exc:
            conversion.fail(exc.message, exc.hint)
            unusable.append(conversion)
            continue
        known = by_sif.get(sif)
        if known is not None:  # two build contexts (or references) that are the very same image
            known.keys.extend(conversion.keys)
            known.tasks.extend(t for t in conversion.tasks if t not in known.tasks)
            known.named_by.extend(conversion.named_by)
            continue
        conversion.sif = sif
        if not force and is_ready(sif):
            conversion.state = ConversionState.CACHED
        by_sif[sif] = conversion
    return [*by_sif.values(), *unusable]


def _author_references(manifest: Manifest) -> list[ImageConversion]:
    """One conversion per reference that task authors set for their verifiers and compose
    services; always from the registry, since nothing here built them."""
    roles: dict[str, list[tuple[str, str | None]]] = {}
    for task, service, role in manifest.author_images():
        assert role.image is not None
        roles.setdefault(role.image, []).append((task, service))
    return [
        ImageConversion(image, image, [], sorted({task for task, _ in named}), named_by=named)
        for image, named in roles.items()
    ]


def _conversion_for(record: ImageRecord, key: str, source: Source) -> ImageConversion:
    users = sorted({*record.tasks, *record.verifier_tasks, *(pair[0] for pair in record.services)})
    if record.sif_sha256 and record.sif:  # built into the store (`build --builder apptainer`)
        conversion = ImageConversion(record.sif, record.sif, [key], users)
    elif source is Source.DOCKER_DAEMON:
        image = record.tagged
        conversion = ImageConversion(image, f"docker-daemon://{image}", [key], users)
    else:
        image = record.reference or record.tagged
        conversion = ImageConversion(image, image, [key], users)
    if record.error:
        conversion.fail(
            f"the image was not built: {record.error}", "fix the build and run `harbor-hpc build`"
        )
    elif source is Source.REGISTRY and record.reference is None and not record.sif_sha256:
        conversion.fail(
            "the image has no registry digest (not pushed yet)",
            "run `harbor-hpc build` to push it, or convert with --source docker-daemon",
        )
    return conversion


def run_conversions(
    manifest_path: Path,
    conversions: list[ImageConversion],
    cache_dir: Path,
    *,
    jobs: int = 2,
    nohttps: bool | None = None,
    force: bool = False,
    slurm: JobRequest | None = None,
    on_done: Callable[[ImageConversion], None] | None = None,
    on_submitted: Callable[[UnitArray], None] | None = None,
) -> list[ImageConversion]:
    """Convert the planned images not yet cached and record every good .sif in the manifest:
    here, `jobs` at a time, or on Slurm as one array job whose elements each ask for `slurm`.

    `on_done` is called once per converted or failed image, as it finishes (for progress);
    `on_submitted` once the Slurm array job is queued.
    """
    cache_dir = cache_dir.expanduser().absolute()
    use_http = resolve_nohttps(nohttps)
    _record(manifest_path, [c for c in conversions if c.state is ConversionState.CACHED])
    todo = [c for c in conversions if c.state is ConversionState.TO_CONVERT]
    if not todo:
        return conversions
    if slurm is None:
        finished = _convert_here(todo, cache_dir, jobs=jobs, nohttps=use_http, force=force)
    else:
        finished = _convert_on_slurm(
            todo, cache_dir, slurm, nohttps=use_http, force=force, on_submitted=on_submitted
        )
    for conversion in finished:
        _record(manifest_path, [conversion])
        if on_done is not None:
            on_done(conversion)
    return conversions


def _record(manifest_path: Path, conversions: list[ImageConversion]) -> None:
    """Write the .sif of each good conversion into the manifest (skipped when already there):
    into its image entries, and for an author's reference into those tasks' records."""
    good = [c for c in conversions if c.ok and c.sif is not None]
    wanted = {key: str(c.sif) for c in good for key in c.keys}
    named = {(*role, c.image): str(c.sif) for c in good for role in c.named_by}
    if not (wanted or named) or _already_recorded(load_manifest(manifest_path), wanted, named):
        return
    with update_manifest(manifest_path) as manifest:
        for key, sif in wanted.items():
            if key in manifest.images:
                manifest.images[key].sif = sif
        for (task, service, image), sif in named.items():
            role = _author_role(manifest, task, service, image)
            if role is not None:
                role.sif = sif


def _author_role(
    manifest: Manifest, task: str, service: str | None, image: str
) -> RoleImage | None:
    """The task's verifier (`service` None) or compose service record while it still names
    the author's `image`."""
    record = manifest.tasks.get(task)
    role = record.role(service) if record else None
    if role is None or role.context is not None or role.image != image:
        return None
    return role


def _already_recorded(
    manifest: Manifest,
    wanted: dict[str, str],
    named: dict[tuple[str, str | None, str], str],
) -> bool:
    images_done = all(
        key not in manifest.images or manifest.images[key].sif == sif for key, sif in wanted.items()
    )
    return images_done and all(
        (role := _author_role(manifest, *key)) is None or role.sif == sif
        for key, sif in named.items()
    )


def _convert_here(
    todo: list[ImageConversion], cache_dir: Path, *, jobs: int, nohttps: bool, force: bool
) -> Iterable[ImageConversion]:
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="convert") as pool:
        futures = {
            pool.submit(_timed_convert, c.source, cache_dir, nohttps, force): c for c in todo
        }
        for future in as_completed(futures):
            conversion = futures[future]
            _apply(conversion, future.result())
            yield conversion


def convert_one(source: str, cache_dir: str, nohttps: bool, force: bool) -> dict[str, Any]:
    """One image into the store; a plain dict either way, so it pickles back from Slurm nodes."""
    return _timed_convert(source, Path(cache_dir), nohttps, force)


def _timed_convert(source: str, cache_dir: Path, nohttps: bool, force: bool) -> dict[str, Any]:
    started = time.monotonic()
    try:
        sif = ensure_sif(source, cache_dir, nohttps=nohttps, force=force)
    except HarborHpcError as exc:
        return {"error": exc.message, "hint": exc.hint, "seconds": time.monotonic() - started}
    return {"sif": str(sif), "seconds": time.monotonic() - started}


def _apply(conversion: ImageConversion, outcome: dict[str, Any]) -> None:
    conversion.seconds = outcome.get("seconds")
    if "sif" in outcome:
        conversion.sif = Path(outcome["sif"])
        conversion.state = ConversionState.CONVERTED
    else:
        # The store names the image first; the report names it already.
        error = str(outcome.get("error")).removeprefix(f"{conversion.source}: ")
        conversion.fail(error, outcome.get("hint"))


def _convert_on_slurm(
    todo: list[ImageConversion],
    cache_dir: Path,
    request: JobRequest,
    *,
    nohttps: bool,
    force: bool,
    on_submitted: Callable[[UnitArray], None] | None,
) -> Iterable[ImageConversion]:
    cluster.require_sbatch(
        "--slurm", hint="run convert on a login node of the cluster, or without --slurm"
    )
    log_dir = unit_log_dir(cache_dir)
    pool = cluster.executor(log_dir / "%j", Executor.SLURM, request)
    # Registry credentials reach the nodes in the environment sbatch exports, never in the
    # job's script or its pickled arguments.
    jobs = cluster.submit_array(
        pool,
        convert_one,
        [c.source for c in todo],
        [str(cache_dir)] * len(todo),
        [nohttps] * len(todo),
        [force] * len(todo),
        what="the conversion job",
        hint="check --partition, --account and --qos (`sinfo` lists the partitions)",
    )
    if on_submitted is not None:
        on_submitted(UnitArray(jobs[0].job_id.split("_")[0], len(jobs), log_dir))
    conversions = {job.job_id: conversion for job, conversion in zip(jobs, todo, strict=True)}
    for job, outcome in cluster.await_array(jobs, retry="run convert again to retry"):
        conversion = conversions[job.job_id]
        _apply(conversion, outcome)
        yield conversion
