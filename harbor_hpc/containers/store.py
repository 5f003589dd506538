"""The .sif store: one checked Apptainer image per distinct container image, in a shared folder.

Images are named by digest (`sha256-<hex>.sif`), so an image is converted once however many
tasks, datasets or users name it. The folder is often shared by many processes and nodes at once,
so a conversion

- holds a per-image kernel lock (`.<name>.lock`; it dies with its process, so a crashed
  converter never blocks the next one),
- writes into a hidden temporary file that does not end in `.sif` and renames it into place only
  when complete and checked (`apptainer exec ... /bin/sh -c true`), so a crash can leave debris
  but nothing that looks finished; the next conversion of that image sweeps the debris up,
- then writes a marker (`.<name>.ok`) recording the size, mtime and sha256 it checked, so later
  runs trust the image after two `stat` calls instead of starting Apptainer.

Images `build --builder apptainer` makes from a Dockerfile (`env-<context hash>.sif`) enter the
store the same way (`store_built`).

Before a .sif is first used on a node its content is hashed and compared with the marker's sha256
(remembered per user and node in `$TMPDIR/harbor-hpc-<uid>/verified`), so an image damaged in
place is converted again from its recorded source instead of being run; `verify` re-checks one on
demand (`convert --verify`).

A lab shares one store by making its folder group-writable (and setgid, so that files keep the
lab's group): every lock, marker, .sif and scratch folder made in such a store is then
group-writable or group-readable too, whatever each member's umask.

Every image is made with `apptainer build` (a registry's too, rather than `pull`), which compresses
its squashfs as `runtime.sif_compression` chooses: zstd where the nodes that run the images read
it (containers read their image through squashfuse, far faster from zstd than from gzip).

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
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_hpc.containers.probes import missing_subid_ranges
from harbor_hpc.containers.sif import node_architecture, write_sif
from harbor_hpc.core.errors import HarborHpcError, InputError, from_os_error
from harbor_hpc.core.files import LockTimeout, atomic_write_json, file_lock
from harbor_hpc.core.proc import run
from harbor_hpc.core.scratch import remove_private_dir
from harbor_hpc.images import layers
from harbor_hpc.images.reference import DIGEST, Reference, is_loopback
from harbor_hpc.runtimes.apptainer import (
    apptainer_here,
    build_command,
    run_flags,
    sif_compression,
)

if TYPE_CHECKING:
    from harbor_hpc.images.registry import Registry

log = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}
# A pull or build of the largest task images over a slow link; past this, something hangs.
CONVERT_TIMEOUT_S = 3 * 3600.0


def resolve_nohttps(nohttps: bool | None) -> bool:
    """Whether to reach registries over plain HTTP: `nohttps` when given (the command line or
    the config decided), else what APPTAINER_NOHTTPS asks for (off unless set)."""
    if nohttps is not None:
        return nohttps
    return os.environ.get("APPTAINER_NOHTTPS", "").strip().lower() in _TRUE


@dataclass(frozen=True)
class ResolvedImage:
    """An image source resolved for the store: `uri` for Apptainer, `name` (its digest) for the
    file in the store. (`convert --source`, where a manifest's images come from, is another idea:
    `harbor_hpc.steps.convert.Source`.)"""

    uri: str
    name: str
    build: bool  # from the local daemon or an archive, not a registry


def resolve_source(source: str, *, nohttps: bool) -> ResolvedImage:
    """Work out where `source` comes from and the digest that names its .sif."""
    if source.startswith("docker-daemon://"):
        image = source.removeprefix("docker-daemon://")
        return ResolvedImage(source, _digest_name(_daemon_image_id(image)), build=True)
    if source.startswith("docker-archive://"):
        archive = Path(source.removeprefix("docker-archive://")).expanduser()
        return ResolvedImage(f"docker-archive://{archive}", _archive_name(archive), build=True)
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
    return ResolvedImage(ref.pinned, _digest_name(ref.digest or ""), build=False)


def _digest_name(digest: str) -> str:
    return digest.replace(":", "-", 1)


def sif_path_for(source: str, cache_dir: Path, *, nohttps: bool | None = None) -> Path:
    """Where the .sif for `source` is (or will be) in `cache_dir`; a .sif path stays as is.

    A tag reference costs one registry request to learn its digest, a docker-daemon source one
    question to Docker; nothing is converted.
    """
    if _is_sif_path(source):
        return Path(source)
    parsed = resolve_source(source, nohttps=resolve_nohttps(nohttps))
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
    """A finished, checked .sif: its marker matches the file as it is now (no Apptainer run, no
    hashing: two `stat` calls)."""
    return _ready_marker(sif) is not None


def _ready_marker(sif: Path) -> dict[str, Any] | None:
    """`sif`'s marker when it records a sha256 and matches the file as it is now, else None."""
    try:
        stat_ = sif.stat()
    except OSError:
        return None
    marker = _read_marker(sif)
    matches = (
        marker is not None
        and isinstance(marker.get("sha256"), str)
        and marker.get("size") == stat_.st_size
        and marker.get("mtime_ns") == stat_.st_mtime_ns
    )
    return marker if matches else None


def verify(sif: Path) -> bool:
    """Hash `sif` now and compare it with the sha256 recorded when it was converted; remembers
    the answer for this node. False for a file without a record or with a different content."""
    marker = _ready_marker(sif)
    return marker is not None and _verify(sif, marker)


def _verify(sif: Path, marker: dict[str, Any]) -> bool:
    good: bool = _sha256(sif) == marker["sha256"]
    record = _node_record(sif, marker)
    if record is not None:
        if good:
            record.touch()
        else:
            record.unlink(missing_ok=True)
    if not good:
        log.warning("%s does not match the sha256 recorded when it was converted", sif)
    return good


def _trusted(sif: Path) -> bool:
    """Ready, and its content verified on this node (hashed now, once per node)."""
    marker = _ready_marker(sif)
    if marker is None:
        return False
    record = _node_record(sif, marker)
    return (record is not None and record.exists()) or _verify(sif, marker)


def checked_sif(sif: Path, *, nohttps: bool | None = None) -> Path:
    """`sif` ready to run here. A store's .sif (one with a marker) is verified against its
    recorded sha256 once per node, and converted again from its recorded source when it does
    not match; any other .sif file is the user's own and returned as is."""
    marker = _read_marker(sif)
    if marker is None or _trusted(sif):
        return sif
    uri, build = marker.get("uri"), marker.get("build")
    if not uri or not isinstance(uri, str) or not isinstance(build, bool):
        raise HarborHpcError(
            f"{sif}: does not match its record, which does not say where it came from",
            hint="convert its image again (harbor-hpc convert --force); an image built into the "
            "store (`build --builder apptainer`): remove it and build again",
        )
    parsed = ResolvedImage(uri, sif.stem, build=build)
    source = str(marker.get("source") or uri)
    return _ensure(parsed, source, sif, use_http=resolve_nohttps(nohttps), force=False)


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
    use_http = resolve_nohttps(nohttps)
    parsed = resolve_source(source, nohttps=use_http)
    final = cache_dir.expanduser().absolute() / f"{parsed.name}.sif"
    return _ensure(parsed, source, final, use_http=use_http, force=force)


def _ensure(
    parsed: ResolvedImage, source: str, final: Path, *, use_http: bool, force: bool
) -> Path:
    if not force and _trusted(final):
        return final
    cache_dir = final.parent
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _image_lock(cache_dir, parsed.name):
            if not force and _trusted(final):
                return final  # another process finished it while we waited
            _sweep(cache_dir, parsed.name)
            if not force and _recoverable(final, parsed):
                return final
            _convert(parsed, source, final, use_http=use_http)
    except OSError as exc:  # the store's folder: permissions, a full disk, a stale NFS handle
        known = from_os_error(exc)
        raise HarborHpcError(
            f"{source}: cannot convert into the .sif store {cache_dir}: {exc}",
            hint=known.hint
            if known is not None and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else "use a --cache-dir you can write (group-writable, for a store users share)",
        ) from None
    return final


def _recoverable(final: Path, parsed: ResolvedImage) -> bool:
    """Whether an existing, unready `final` can be trusted again without converting: its content
    is still what was recorded (only its time stamps changed), or it was finished by a converter
    that crashed before writing its marker and it runs. Only a lock holder may call this."""
    if not final.exists():
        return False
    marker = _read_marker(final)
    if marker is not None and isinstance(marker.get("sha256"), str):
        digest = _sha256(final)
        if digest != marker["sha256"]:
            log.warning(
                "%s does not match the sha256 recorded when it was converted: converting it again",
                final,
            )
            return False
        mark_checked(final, parsed, str(marker.get("source") or parsed.uri), sha256=digest)
        return True
    if _usable(final):
        mark_checked(final, parsed, parsed.uri)
        return True
    return False


@contextlib.contextmanager
def _image_lock(cache_dir: Path, name: str) -> Iterator[None]:
    lock = cache_dir / f".{name}.lock"
    mode = 0o664 if _shared(cache_dir) else None
    with ExitStack() as stack:
        try:
            stack.enter_context(file_lock(lock, timeout=0, mode=mode))
        except LockTimeout as busy:
            log.info("waiting: %s", busy.message)
            stack.enter_context(file_lock(lock, mode=mode))
        yield


def _shared(cache_dir: Path) -> bool:
    """A store a group shares: its folder is group-writable."""
    try:
        return bool(cache_dir.stat().st_mode & stat.S_IWGRP)
    except OSError:
        return False


def _sweep(cache_dir: Path, name: str) -> None:
    """Remove what crashed conversions of `name` left; only a lock holder may call this. What
    another user left may resist; it is only debris."""
    for debris in cache_dir.glob(f".{name}.*.partial"):
        log.info("removing %s, left by a conversion that did not finish", debris)
        with contextlib.suppress(OSError):
            debris.unlink()
    for work in _work_root(cache_dir).glob(f"{name}.*"):
        remove_private_dir(work)  # a root laid out from layers holds files of subordinate ids


def _work_root(cache_dir: Path) -> Path:
    root = os.environ.get("APPTAINER_TMPDIR")
    return Path(root) if root else cache_dir / ".tmp"


def _process_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _usable(sif: Path) -> bool:
    try:
        run_flags(sif)
    except HarborHpcError as exc:
        log.warning("%s does not run, converting again: %s", sif, exc.message)
        return False
    return True


def _convert(parsed: ResolvedImage, source: str, final: Path, *, use_http: bool) -> None:
    partial = final.with_name(f".{parsed.name}.{_process_tag()}.partial")
    shared = _shared(final.parent)
    root = _work_root(final.parent)
    root.mkdir(parents=True, exist_ok=True)
    if shared and root.stat().st_uid == os.geteuid():
        root.chmod(0o2775)  # every member makes their scratch folders in it
    work = root / f"{parsed.name}.{_process_tag()}"
    # A loopback registry speaks plain HTTP, as Docker assumes without being told.
    use_http = use_http or (not parsed.build and is_loopback(Reference.parse(parsed.uri).host))
    env = dict(os.environ)
    # Both names, so that Singularity and Apptainer alike keep their scratch out of $HOME.
    for prefix in ("APPTAINER", "SINGULARITY"):
        env[f"{prefix}_CACHEDIR"] = str(work / "cache")
        env[f"{prefix}_TMPDIR"] = str(work)
        if use_http:
            env[f"{prefix}_NOHTTPS"] = "1"
        else:
            env.pop(f"{prefix}_NOHTTPS", None)
    apptainer = apptainer_here()
    started = time.monotonic()
    log.info("converting %s -> %s%s", source, final.name, "" if apptainer else " (no Apptainer)")
    try:
        (work / "cache").mkdir(parents=True)
        if apptainer:
            # `build` rather than `pull` for a registry's image too: only build compresses the
            # .sif as asked (sif_compression).
            command = build_command("--disable-cache", str(partial), parsed.uri)
            result = run(command, timeout=CONVERT_TIMEOUT_S, env=env)
            if not result.ok or not partial.is_file():
                said = result.error or _apptainer_error(result.stderr)
                raise HarborHpcError(
                    f"{source}: apptainer build failed: {said}",
                    hint=failure_hint(result.stderr, use_http=use_http),
                )
            run_flags(partial)  # raises, naming each attempt, when the new image does not run
        else:
            _convert_by_layers(parsed, source, partial, work, use_http=use_http)
        if shared:
            partial.chmod(partial.stat().st_mode | 0o040)  # every member reads it
        digest = _sha256(partial)
        os.replace(partial, final)
        mark_checked(final, parsed, source, sha256=digest)
    finally:
        partial.unlink(missing_ok=True)
        remove_private_dir(work)
    log.info("converted %s in %.1f s", source, time.monotonic() - started)


def _convert_by_layers(
    parsed: ResolvedImage, source: str, partial: Path, work: Path, *, use_http: bool
) -> None:
    """`partial`, the .sif of `source` made without Apptainer (an enroot cluster's nodes): its
    layers, from its registry or `docker save`, laid into a root folder and squashed as root of
    the user's namespace (images/layers.py), then written as Apptainer writes a SIF."""
    architecture = node_architecture()
    if parsed.build:
        if parsed.uri.startswith("docker-daemon://"):
            archive = work / "saved.tar"
            saved = run(
                ["docker", "save", "-o", str(archive), parsed.uri.removeprefix("docker-daemon://")],
                timeout=CONVERT_TIMEOUT_S,
            )
            if not saved.ok:
                raise HarborHpcError(f"{source}: docker save failed: {saved.why()}")
        else:
            archive = Path(parsed.uri.removeprefix("docker-archive://"))
        image = layers.from_archive(archive, work)
    else:
        ref = Reference.parse(parsed.uri)
        registry = _apptainer_registry(ref.host, plain_http=use_http)
        image = layers.from_registry(registry, ref.repository, ref.digest or "", architecture, work)
    squashfs = work / "root.sqfs"
    ranges = () if missing_subid_ranges() else ("--map-auto",)
    command = [
        *("unshare", "--map-root-user", *ranges),
        *(sys.executable, "-m", "harbor_hpc.images.layers"),
        *(str(work / "root"), str(squashfs), json.dumps(sif_compression().squashfs_args)),
        *(str(layer) for layer in image.layers),
    ]
    done = run(command, timeout=CONVERT_TIMEOUT_S)
    if not done.ok:
        said = done.stderr.strip().splitlines()
        raise HarborHpcError(
            f"{source}: cannot make its root file system here: {said[-1] if said else done.why()}",
            hint=None if done.returncode == 2 else "`harbor-hpc doctor` checks this node",
        )
    if not ranges:
        log.warning(
            "%s: every file of the image is root's: you have no /etc/subuid range here", source
        )
    write_sif(squashfs, image.config, image.architecture or architecture, partial)


def store_built(built: Path, final: Path, origin: str) -> str:
    """Put a .sif made here rather than converted (`build --builder apptainer`) into the store as
    `final`, as a conversion finishes: under the image's lock, checked to run, readable by a
    shared store's group, renamed into place, marked with its sha256 (returned) for `is_ready`,
    `convert` and the environment. Its marker names `origin` but no source to convert from."""
    cache_dir = final.parent
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _image_lock(cache_dir, final.stem):
            _sweep(cache_dir, final.stem)
            partial = final.with_name(f".{final.stem}.{_process_tag()}.partial")
            try:
                shutil.move(built, partial)  # a rename when both are on one filesystem
                run_flags(partial)
                if _shared(cache_dir):
                    partial.chmod(partial.stat().st_mode | 0o040)
                digest = _sha256(partial)
                os.replace(partial, final)
                mark_checked(
                    final, ResolvedImage("", final.stem, build=True), origin, sha256=digest
                )
            finally:
                partial.unlink(missing_ok=True)
    except OSError as exc:
        known = from_os_error(exc)
        raise HarborHpcError(
            f"{origin}: cannot put the image into the .sif store {cache_dir}: {exc}",
            hint=known.hint if known is not None else "use a --cache-dir you can write",
        ) from None
    return digest


def mark_checked(
    sif: Path, parsed: ResolvedImage, source: str, *, sha256: str | None = None
) -> None:
    """Record that `sif`, as it is now, was checked to run, with its content's sha256 and where
    it came from: `is_ready` trusts it from here on, and a damaged copy can be made again."""
    stat_ = sif.stat()
    marker = {
        "source": source,
        "uri": parsed.uri,
        "build": parsed.build,
        "size": stat_.st_size,
        "mtime_ns": stat_.st_mtime_ns,
        "sha256": sha256 or _sha256(sif),
        "checked_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "checked_on": socket.gethostname(),
    }
    atomic_write_json(_marker_path(sif), marker, mode=0o664 if _shared(sif.parent) else None)
    record = _node_record(sif, marker)
    if record is not None:
        record.touch()


def recorded_sha256(sif: Path) -> str | None:
    """The sha256 recorded when `sif` entered the store, or None."""
    marker = _read_marker(sif)
    digest = marker.get("sha256") if marker else None
    return digest if isinstance(digest, str) else None


def _marker_path(sif: Path) -> Path:
    return sif.with_name(f".{sif.stem}.ok")


def _read_marker(sif: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads(_marker_path(sif).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return "sha256:" + hashlib.file_digest(handle, "sha256").hexdigest()


def _node_record(sif: Path, marker: dict[str, Any]) -> Path | None:
    """The file that says this user verified `sif`, as it is now, on this node; None when the
    node's private folder for such records cannot be had (then every use hashes)."""
    private = Path(tempfile.gettempdir()) / f"harbor-hpc-{os.geteuid()}"
    folder = private / "verified"
    try:
        private.mkdir(mode=0o700, exist_ok=True)
        owner = private.stat()
        # A folder another user made in /tmp could hold forged records.
        if owner.st_uid != os.geteuid() or owner.st_mode & 0o077:
            return None
        folder.mkdir(exist_ok=True)
        stat_ = sif.stat()
    except OSError:
        return None
    identity = (
        f"{sif.absolute()}|{stat_.st_dev}|{stat_.st_ino}|{stat_.st_size}|{stat_.st_mtime_ns}"
        f"|{marker.get('sha256')}"
    )
    return folder / hashlib.sha256(identity.encode()).hexdigest()


def _apptainer_error(stderr: str) -> str:
    """Apptainer's own complaint (its FATAL/ERROR lines), not its INFO chatter."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr)  # Apptainer colours even when piped
    lines = [line.strip() for line in plain.splitlines() if line.strip()]
    serious = [line for line in lines if line.startswith(("FATAL", "ERROR"))]
    text = " ".join(re.sub(r"^(FATAL|ERROR)\s*:\s*", "", line) for line in serious or lines[-3:])
    return (text or "no error message")[-800:]


def failure_hint(stderr: str, *, use_http: bool) -> str:
    lowered = stderr.lower()
    if "no space left on device" in lowered or "disk quota exceeded" in lowered:
        return (
            "the store's filesystem (or APPTAINER_TMPDIR's) is full: free space or use another "
            "--cache-dir, then run again"
        )
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
        registry = _apptainer_registry(ref.host, plain_http=resolve_nohttps(nohttps))
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
