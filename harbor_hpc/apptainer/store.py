"""The .sif store: one checked Apptainer image per distinct container image, in a shared folder.

Images are named by digest (`sha256-<hex>.sif`), so an image is converted once however many
tasks, datasets or users name it. The folder is often shared by many processes and nodes at once,
so a conversion

- holds a per-image kernel lock (`.<name>.lock`; it dies with its process, so a crashed
  converter never blocks the next one),
- writes into a hidden temporary file that does not end in `.sif` and renames it into place only
  when complete and checked (`apptainer exec ... /bin/sh -c true`), so a crash can leave debris
  but nothing that looks finished; the next conversion of that image sweeps the debris up,
- then writes a marker (`.<name>.ok`) recording the size and mtime it checked, so later runs
  trust the image after two `stat` calls instead of starting Apptainer.

Apptainer's own cache and temporary folders point into the store (`.tmp/<name>`, or
`$APPTAINER_TMPDIR/<name>` when the user names a faster local disk), wiped after each
conversion, rather than `$HOME`; its layer cache is off: the .sif is the cache.

Apptainer is called directly, not through spython: spython 0.3.14 runs a hard-coded `singularity`
binary with the parent's environment only, while each conversion needs its own
APPTAINER_CACHEDIR/APPTAINER_TMPDIR and the registry credentials passed in the environment (never
on a command line) from worker threads, where changing `os.environ` is unsafe. Its `pull` also
cannot take pull options such as `--no-https` or `--disable-cache`, knows no `docker-daemon://`,
and reports a failed command as printed output rather than an exception with Apptainer's error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tarfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from harbor_hpc.apptainer.runtime import find_apptainer, run_flags
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.files import LockTimeout, atomic_write_json, file_lock
from harbor_hpc.core.proc import run
from harbor_hpc.images.reference import DIGEST, Reference

if TYPE_CHECKING:
    from harbor_hpc.images.registry import Registry

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
# A pull or build of the largest task images over a slow link; past this, something hangs.
CONVERT_TIMEOUT_S = 3 * 3600.0


def nohttps_default() -> bool:
    """Whether APPTAINER_NOHTTPS asks for plain HTTP to registries (off unless set)."""
    return os.environ.get("APPTAINER_NOHTTPS", "").strip().lower() in _TRUE


@dataclass(frozen=True)
class Source:
    """What to convert and how: `uri` for Apptainer, `name` for the file in the store."""

    uri: str
    name: str
    build: bool  # `apptainer build` (daemon, archive) rather than `pull` (registry)


def parse_source(source: str, *, nohttps: bool) -> Source:
    """Work out where `source` comes from and the digest that names its .sif."""
    if source.startswith("docker-daemon://"):
        image = source.removeprefix("docker-daemon://")
        return Source(source, _digest_name(_daemon_image_id(image)), build=True)
    if source.startswith("docker-archive://"):
        archive = Path(source.removeprefix("docker-archive://")).expanduser()
        return Source(f"docker-archive://{archive}", _archive_name(archive), build=True)
    if "://" in source and not source.startswith("docker://"):
        raise InputError(
            f"{source}: unsupported image source",
            hint="use a registry reference (REG/NS/NAME@sha256:...), docker://..., "
            "docker-daemon://IMAGE:TAG, docker-archive://FILE.tar or a .sif file",
        )
    ref = Reference.parse(source)
    if ref.digest is None:
        # Pinned to what the tag names now, so the file's name and content agree even if the
        # tag moves during the conversion.
        ref = replace(ref, digest=resolve_digest(ref, nohttps=nohttps))
    return Source(ref.pinned, _digest_name(ref.digest or ""), build=False)


def _digest_name(digest: str) -> str:
    return digest.replace(":", "-", 1)


def sif_path_for(source: str, cache_dir: Path, *, nohttps: bool | None = None) -> Path:
    """Where the .sif for `source` is (or will be) in `cache_dir`; a .sif path stays as is.

    A tag reference costs one registry request to learn its digest, a docker-daemon source one
    question to Docker; nothing is converted.
    """
    if _is_sif_path(source):
        return Path(source)
    parsed = parse_source(source, nohttps=nohttps_default() if nohttps is None else nohttps)
    return cache_dir / f"{parsed.name}.sif"


def _is_sif_path(source: str) -> bool:
    return "://" not in source and source.endswith(".sif")


def sif_file(image: str, task_environment: Path) -> Path | None:
    """The .sif file a task's `docker_image` names, or None when it is a registry reference.

    A relative name is the task's own (under its environment/ folder) when such a file exists.
    """
    if not _is_sif_path(image):
        return None
    path = Path(image).expanduser()
    if not path.is_absolute() and (task_environment / path).is_file():
        return task_environment / path
    return path


def is_ready(sif: Path) -> bool:
    """A finished, checked .sif: its marker matches the file as it is now (no Apptainer run)."""
    try:
        stat = sif.stat()
        marker = json.loads(_marker_path(sif).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("size") == stat.st_size
        and marker.get("mtime_ns") == stat.st_mtime_ns
    )


def ensure_sif(
    source: str, cache_dir: Path, *, nohttps: bool | None = None, force: bool = False
) -> Path:
    """The checked .sif for `source` in `cache_dir`, converting it only when it is missing.

    `source` is a registry reference (`REG/NS/NAME@sha256:...`, a tag reference, `docker://...`),
    `docker-daemon://IMAGE:TAG`, `docker-archive://FILE.tar`, or an existing .sif path (returned
    as is). `nohttps` (default: APPTAINER_NOHTTPS) reaches the registry over plain HTTP.
    Registry credentials come from APPTAINER_DOCKER_USERNAME / APPTAINER_DOCKER_PASSWORD.
    Safe to call from many processes and nodes on one shared `cache_dir` at once.
    """
    if _is_sif_path(source):
        path = Path(source)
        if not path.is_file():
            raise InputError(f"{source}: no such .sif file")
        return path
    use_http = nohttps_default() if nohttps is None else nohttps
    parsed = parse_source(source, nohttps=use_http)
    cache_dir = cache_dir.expanduser().absolute()
    final = cache_dir / f"{parsed.name}.sif"
    if not force and is_ready(final):
        return final
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _image_lock(cache_dir, parsed.name):
            if not force and is_ready(final):
                return final  # another process finished it while we waited
            _sweep(cache_dir, parsed.name)
            if not force and final.exists() and _usable(final):
                mark_checked(final, source)  # finished earlier, crashed before its marker
                return final
            _convert(parsed, source, final, use_http=use_http)
    except OSError as exc:  # the store's folder: permissions, a full disk, a stale NFS handle
        raise HarborHpcError(
            f"{source}: cannot convert into the .sif store {cache_dir}: {exc}",
            hint="use a --cache-dir you can write (group-writable, for a store users share)",
        ) from None
    return final


@contextlib.contextmanager
def _image_lock(cache_dir: Path, name: str) -> Iterator[None]:
    lock = cache_dir / f".{name}.lock"
    with ExitStack() as stack:
        try:
            stack.enter_context(file_lock(lock, timeout=0))
        except LockTimeout as busy:
            log.info("waiting: %s", busy.message)
            stack.enter_context(file_lock(lock))
        yield


def _sweep(cache_dir: Path, name: str) -> None:
    """Remove what a crashed conversion of `name` left; only a lock holder may call this."""
    for debris in cache_dir.glob(f".{name}.*.partial"):
        log.info("removing %s, left by a conversion that did not finish", debris)
        debris.unlink(missing_ok=True)
    shutil.rmtree(_work_dir(cache_dir, name), ignore_errors=True)


def _work_dir(cache_dir: Path, name: str) -> Path:
    root = os.environ.get("APPTAINER_TMPDIR")
    return (Path(root) if root else cache_dir / ".tmp") / name


def _usable(sif: Path) -> bool:
    try:
        run_flags(sif)
    except HarborHpcError as exc:
        log.warning("%s does not run, converting again: %s", sif, exc.message)
        return False
    return True


def _convert(parsed: Source, source: str, final: Path, *, use_http: bool) -> None:
    partial = final.with_name(f".{parsed.name}.{socket.gethostname()}-{os.getpid()}.partial")
    work = _work_dir(final.parent, parsed.name)
    (work / "cache").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # Both names, so that Singularity and Apptainer alike keep their scratch out of $HOME.
    for prefix in ("APPTAINER", "SINGULARITY"):
        env[f"{prefix}_CACHEDIR"] = str(work / "cache")
        env[f"{prefix}_TMPDIR"] = str(work)
        if use_http:
            env[f"{prefix}_NOHTTPS"] = "1"
        else:
            env.pop(f"{prefix}_NOHTTPS", None)
    verb = "build" if parsed.build else "pull"
    command = [find_apptainer(), verb, "--disable-cache", str(partial), parsed.uri]
    started = time.monotonic()
    log.info("converting %s -> %s", source, final.name)
    try:
        result = run(command, timeout=CONVERT_TIMEOUT_S, env=env)
        if not result.ok or not partial.is_file():
            said = result.error or _apptainer_error(result.stderr)
            raise HarborHpcError(
                f"{source}: apptainer {verb} failed: {said}",
                hint=_failure_hint(result.stderr, use_http=use_http),
            )
        run_flags(partial)  # raises, naming each attempt, when the new image does not run
        os.replace(partial, final)
        mark_checked(final, source)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    log.info("converted %s in %.1f s", source, time.monotonic() - started)


def mark_checked(sif: Path, source: str) -> None:
    """Record that `sif`, as it is now, was checked to run: `is_ready` trusts it from here on."""
    stat = sif.stat()
    atomic_write_json(
        _marker_path(sif),
        {
            "source": source,
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "checked_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "checked_on": socket.gethostname(),
        },
    )


def _marker_path(sif: Path) -> Path:
    return sif.with_name(f".{sif.stem}.ok")


def _apptainer_error(stderr: str) -> str:
    """Apptainer's own complaint (its FATAL/ERROR lines), not its INFO chatter."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr)  # Apptainer colours even when piped
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    serious = [line for line in lines if line.startswith(("FATAL", "ERROR"))]
    text = " ".join(re.sub(r"^(FATAL|ERROR)\s*:\s*", "", line) for line in serious or lines[-3:])
    return (text or "no error message")[-800:]


def _failure_hint(stderr: str, *, use_http: bool) -> str:
    if "server gave HTTP response to HTTPS client" in stderr:
        return "the registry speaks plain HTTP: pass --nohttps (or set APPTAINER_NOHTTPS=1)"
    if "unauthorized" in stderr.lower() or "authentication required" in stderr.lower():
        return "set APPTAINER_DOCKER_USERNAME and APPTAINER_DOCKER_PASSWORD for this registry"
    if "manifest unknown" in stderr or "not found" in stderr:
        return "check that the image was pushed (`harbor-hpc build`) and the reference is right"
    return "run again with -v; `harbor-hpc doctor` checks Apptainer, user namespaces and FUSE"


def _daemon_image_id(image: str) -> str:
    """The image ID (config digest) of a local Docker image; the same as `docker save` names."""
    import docker  # imported here: only docker-daemon sources need the Docker client
    import docker.errors

    try:
        client = docker.from_env()
        try:
            image_id: str = client.images.get(image).id
        finally:
            client.close()
    except docker.errors.ImageNotFound:
        raise HarborHpcError(
            f"docker-daemon://{image}: no such image in the local Docker daemon",
            hint="build or tag it first, or convert from the registry instead",
        ) from None
    except docker.errors.DockerException as exc:
        raise HarborHpcError(
            f"docker-daemon://{image}: cannot ask Docker ({exc})",
            hint="is the Docker daemon running and is its socket readable by you?",
        ) from None
    return image_id


def _archive_name(archive: Path) -> str:
    """Name a `docker save` archive by its image's config digest (as the daemon names it);
    archives without a Docker manifest (e.g. OCI layouts) by a hash of the file."""
    if not archive.is_file():
        raise InputError(f"docker-archive://{archive}: no such file")
    try:
        with tarfile.open(archive) as tar:
            member = tar.extractfile("manifest.json")
            manifest = json.load(member) if member else None
        config = manifest[0]["Config"] if isinstance(manifest, list) and manifest else ""
    except (tarfile.TarError, KeyError, ValueError, TypeError, IndexError):
        config = ""
    except OSError as exc:
        raise HarborHpcError(f"docker-archive://{archive}: cannot read it ({exc})") from None
    hex_part = Path(config).name.removesuffix(".json")
    if re.fullmatch(r"[0-9a-f]{64}", hex_part):
        return f"sha256-{hex_part}"
    digest = hashlib.sha256()
    with archive.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return f"sha256-{digest.hexdigest()}"


def unavailable(source: str, cache_dir: Path, *, nohttps: bool | None = None) -> str | None:
    """Why no node could get `source` (a registry reference), or None when the store holds its
    .sif or its registry has it (asked from here, with Apptainer's credentials): a node would
    otherwise find out only after its job waited in the queue."""
    try:
        ref = Reference.parse(source)
        if ref.digest is not None and is_ready(cache_dir / f"{_digest_name(ref.digest)}.sif"):
            return None
        registry = _apptainer_registry(
            ref.host, plain_http=nohttps_default() if nohttps is None else nohttps
        )
        found = registry.manifest_digest(ref.repository, ref.digest or ref.tag or "latest")
    except HarborHpcError as exc:
        return exc.message
    return None if found else f"{source}: no such image in {ref.host}"


def resolve_digest(ref: Reference, *, nohttps: bool) -> str:
    """The digest a tag points at now, asked of the registry's v2 API with the credentials
    Apptainer will use (APPTAINER_DOCKER_USERNAME/PASSWORD, else the user's `docker login`)."""
    registry = _apptainer_registry(ref.host, plain_http=nohttps)
    digest = registry.manifest_digest(ref.repository, ref.tag or "latest")
    if digest is None or not DIGEST.match(digest):
        raise HarborHpcError(
            f"{ref}: no such image or tag in the registry",
            hint="check the reference, or push the image (`harbor-hpc build`)",
        )
    return digest


def _apptainer_registry(host: str, *, plain_http: bool) -> Registry:
    """The build step's registry client, logged in as Apptainer will be: compute nodes have no
    Docker login, users give Apptainer its credentials in the environment instead."""
    from harbor_hpc.images.registry import Registry  # here: `requests` is slow to import

    user = os.environ.get("APPTAINER_DOCKER_USERNAME")
    password = os.environ.get("APPTAINER_DOCKER_PASSWORD")
    credentials = (
        {"username": user, "password": password} if user and password is not None else None
    )
    return Registry(host, plain_http=plain_http, credentials=credentials)
