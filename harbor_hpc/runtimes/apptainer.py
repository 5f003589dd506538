"""Finding Apptainer (or Singularity) and the flags that let the current user run images here.

Clusters install Apptainer setuid or rely on unprivileged user namespaces; root on some machines
lacks a capability that the setuid path asks for. Rather than guess, `run_flags` tries a tiny
`exec` of an image and keeps the first flag set that works. What works depends on the user and
the host far more than on the image, so the set that worked last is tried first next time: one
probe per image instead of one per candidate.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from harbor_hpc.core.config import load_config
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.proc import Ran, run
from harbor_hpc.runtimes import apptainer_nodes
from harbor_hpc.runtimes.base import Start

log = logging.getLogger(__name__)

BINARIES = ("apptainer", "singularity")
# The FUSE helpers Apptainer's starter runs beside a container (its image, its overlay): its
# children, in the container's mount namespace, which they keep alive while they run.
FUSE_HELPERS = frozenset({"squashfuse", "squashfuse_ll", "fuse-overlayfs", "fuse2fs"})

# A probe is one `exec` of a shell; a minute means a hung FUSE mount or a wedged starter, not
# a slow image.
PROBE_TIMEOUT_S = 60.0

# The oldest Apptainer with what an unprivileged user needs of it, from its changelog (1.1.0):
# SIF images mounted with squashfuse, overlays (fuse-overlayfs) and --writable-tmpfs without
# setuid, --fakeroot without an /etc/subuid range (a root-mapped namespace and the fakeroot
# command), and image binds (`-B x.sif:/v:id=N,image-src=/`) through the same driver.
MINIMUM = (1, 1, 0)
# `apptainer build --mksquashfs-args` and SIFs whose squashfs is zstd (1.4.0: "Add new build
# option --mksquashfs-args"; older ones call such an image corrupted).
ZSTD_MINIMUM = (1, 4, 0)
TESTED = "Apptainer 1.4.5"
_VERSION = re.compile(r"^(apptainer|singularity-ce|singularity) version v?(\d+)\.(\d+)\.(\d+)")


@dataclass(frozen=True)
class Version:
    """What `apptainer --version` says: the project (apptainer, singularity-ce, singularity)
    and its release."""

    project: str
    release: tuple[int, int, int]

    def __str__(self) -> str:
        return f"{self.project} {'.'.join(map(str, self.release))}"

    def problem(self) -> str | None:
        """Why harbor-hpc cannot run on it, or None."""
        if self.project != "apptainer":
            return (
                f"{self}: harbor-hpc runs on Apptainer {'.'.join(map(str, MINIMUM))} or newer "
                "(SingularityCE cannot, without setuid, bind a SIF's partition, read zstd "
                "images or run --fakeroot without an /etc/subuid range)"
            )
        if self.release < MINIMUM:
            return (
                f"{self}: harbor-hpc needs Apptainer {'.'.join(map(str, MINIMUM))} or newer "
                "(SIF images, overlays and --fakeroot without setuid)"
            )
        return None


@cache
def apptainer_version(binary: str) -> Version | None:
    """The version `binary --version` reports; None when it says something else."""
    said = run([binary, "--version"], timeout=PROBE_TIMEOUT_S)
    found = _VERSION.match(said.stdout.strip()) if said.ok else None
    if found is None:
        return None
    major, minor, patch = (int(part) for part in found.groups()[1:])
    return Version(found.group(1), (major, minor, patch))


@cache
def find_apptainer() -> str:
    """The Apptainer or Singularity binary on PATH (`HARBOR_HPC_APPTAINER` overrides)."""
    override = os.environ.get("HARBOR_HPC_APPTAINER")
    if override:
        return override
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    raise HarborHpcError(
        "neither apptainer nor singularity is on PATH",
        hint="load it (`module load apptainer`) or install Apptainer; `harbor-hpc doctor` checks",
    )


def apptainer_here() -> bool:
    """Whether this node has an Apptainer to call (what `find_apptainer` names is a program)."""
    return local_apptainer() is not None


def local_apptainer() -> str | None:
    """`find_apptainer`'s binary where this node can call it, else None (an enroot cluster's
    node has none)."""
    try:
        binary = find_apptainer()
    except HarborHpcError:
        return None
    return binary if shutil.which(binary) is not None else None


# Root in the container, as Docker gives it: a user namespace mapping the user to root, with
# the user's /etc/subuid range for the image's other users (Apptainer falls back to a
# root-mapped namespace of the user alone where there is no range).
FAKEROOT: tuple[str, ...] = ("--fakeroot",)
# Without root in the container: what a cluster user normally needs (nothing), then user
# namespaces (unprivileged installs, or root without the full capability set).
CANDIDATE_FLAGS: tuple[tuple[str, ...], ...] = ((), ("--userns",))
# What to ask for when neither works: one sentence, shared by the environment and doctor.
FAKEROOT_HINT = (
    "ask the cluster admins for unprivileged user namespaces (user.max_user_namespaces > 0) "
    "and /etc/subuid + /etc/subgid ranges for your user; or run tasks as yourself with "
    "--environment-kwarg fakeroot=false (tasks that need root in the container then fail)"
)

_last_working: tuple[str, ...] | None = None
_last_working_guard = threading.Lock()


@cache
def run_flags(sif: Path, *, fakeroot: bool = False) -> tuple[str, ...]:
    """Flags for `apptainer exec/instance` that work for this user with this image.

    Raises `HarborHpcError` with each attempt's error when the image runs with none of them,
    which is also how the .sif store checks that a fresh conversion is usable.
    """
    global _last_working
    candidates: list[tuple[str, ...]] = [FAKEROOT] if fakeroot else list(CANDIDATE_FLAGS)
    with _last_working_guard:
        last = _last_working
    if last is not None and last in candidates:
        candidates.remove(last)
        candidates.insert(0, last)
    flags, failures = first_that_runs(sif, candidates)
    if flags is not None:
        with _last_working_guard:
            _last_working = flags
        return flags
    said = "\n  ".join(f"{' '.join(tried) or '(no flags)'}: {why}" for tried, why in failures)
    if _UNREADABLE_ZSTD in said:
        hint = (
            "the .sif is compressed with zstd, which this node's Apptainer (older than 1.4) "
            "cannot read: `harbor-hpc doctor --nodes` asks every node, after which images are "
            'made with gzip (or set sif_compression = "gzip" in harbor-hpc.toml); then '
            "`harbor-hpc convert --force`"
        )
    else:
        hint = site_policy_fix(said) or (FAKEROOT_HINT + "; " if fakeroot else "") + (
            "`harbor-hpc doctor` shows what is missing (user namespaces, subuid, /dev/fuse)"
        )
    raise HarborHpcError(f"apptainer cannot run {sif} here:\n  {said}", hint=hint)


def first_that_runs(
    sif: Path, candidates: Sequence[tuple[str, ...]]
) -> tuple[tuple[str, ...] | None, list[tuple[tuple[str, ...], str]]]:
    """The first flag set of `candidates` with which `sif` runs (None if none does), and why
    each one tried before it failed."""
    failures: list[tuple[tuple[str, ...], str]] = []
    for flags in candidates:
        attempt = try_exec(sif, flags)
        if attempt.ok:
            return flags, failures
        failures.append((flags, attempt.why()))
    return None, failures


def try_exec(sif: Path, flags: Sequence[str], script: str = "true") -> Ran:
    """`exec` of a shell `script` in `sif` with `flags`: the probe behind every choice here."""
    return run(
        [find_apptainer(), "exec", *flags, str(sif), "/bin/sh", "-c", script],
        timeout=PROBE_TIMEOUT_S,
    )


# How a .sif's squashfs is compressed. Through squashfuse (every unprivileged container reads
# its image so), zstd reads back far faster than mksquashfs's default gzip: a container's
# python3 starts in about half the time (issue 28). At level 3 it also packs some 20 times
# faster than gzip (a 190 MB root: 1.1 s of CPU against 23 s; level 15, zstd's default in
# mksquashfs, takes 25 s) into a file within 4% of gzip's. Apptainer's own packages build their
# squashfuse with zstd; images made before keep working as they are.
SQUASHFS_COMPRESSION = "zstd"
SQUASHFS_ARGS = ("-comp", SQUASHFS_COMPRESSION, "-Xcompression-level", "3")


# "auto" (the default): zstd where every node that will run the image reads it, else gzip.
COMPRESSIONS = ("auto", "zstd", "gzip")
# What Apptainer before 1.4 says of a zstd squashfs (its partition check knows no zstd).
_UNREADABLE_ZSTD = "unknown compression algorithm value 6"


@dataclass(frozen=True)
class Compression:
    """How this process squashes every .sif it makes, and why."""

    name: str  # "zstd" or "gzip"
    why: str
    # gzip only because the nodes that will run the images were never asked (doctor --nodes).
    askable: bool = False

    @property
    def squashfs_args(self) -> tuple[str, ...]:
        """mksquashfs's options for it: none for gzip, mksquashfs's default."""
        return SQUASHFS_ARGS if self.name == SQUASHFS_COMPRESSION else ()

    @property
    def options(self) -> tuple[str, ...]:
        """`apptainer build` options for it."""
        args = self.squashfs_args
        return ("--mksquashfs-args", " ".join(args)) if args else ()


@cache
def zstd_here() -> str | None:
    """None when this node makes zstd images (Apptainer 1.4 or newer where there is Apptainer,
    a mksquashfs that takes SQUASHFS_ARGS, tried on an empty folder), else why not."""
    binary = local_apptainer()
    version = apptainer_version(binary) if binary else None
    mksquashfs = shutil.which("mksquashfs")
    if binary and (version is None or version.release < ZSTD_MINIMUM):
        return f"this node's {version or 'Apptainer'} makes no zstd images (1.4 does)"
    if mksquashfs is None:
        return "mksquashfs is not on PATH (Apptainer then uses its own, with gzip)"
    with tempfile.TemporaryDirectory(prefix="harbor-hpc-mksquashfs-") as scratch:
        empty = Path(scratch) / "empty"
        empty.mkdir()
        probe = f"{scratch}/probe.sqfs"
        tried = run(
            [mksquashfs, str(empty), probe, *SQUASHFS_ARGS, "-no-progress"],
            timeout=PROBE_TIMEOUT_S,
        )
    return None if tried.ok else f"{mksquashfs} takes no zstd: {tried.why()}"


@cache
def sif_compression() -> Compression:
    """How .sif files are compressed here: harbor-hpc.toml's `sif_compression`, "auto" by
    default, which is zstd where this node makes it and the nodes that will run the images
    read it: this node alone where there is no Slurm here, else the partitions' nodes as they
    answered `harbor-hpc doctor --nodes` (runtimes/apptainer_nodes.py); gzip, which every Apptainer
    reads, where that is not known."""
    config = load_config()
    chosen = config.values.get("sif_compression", COMPRESSIONS[0])
    if chosen not in COMPRESSIONS:
        raise InputError(
            f"{config.source}: sif_compression must be one of {', '.join(COMPRESSIONS)}, "
            f"not {chosen!r}"
        )
    if chosen == "gzip":
        return Compression("gzip", f'{config.source} says sif_compression = "gzip"')
    cannot = zstd_here()
    if cannot is not None:
        return Compression("gzip", cannot)
    if chosen == "zstd":
        return Compression("zstd", f'{config.source} says sif_compression = "zstd"')
    if shutil.which("sbatch") is None:
        return Compression("zstd", "no Slurm here: images run on this node, which reads zstd")
    reads, why = apptainer_nodes.zstd_verdict()
    return Compression("zstd" if reads else "gzip", why, askable=reads is None)


def build_command(
    *arguments: str, binary: str | None = None, compression: Compression | None = None
) -> list[str]:
    """`apptainer build ARGUMENTS`, its .sif compressed as `compression` says, else as every
    .sif of ours is (`sif_compression`); `binary`: an apptainer found already, else
    `find_apptainer()`."""
    chosen = compression or sif_compression()
    if compression is None and chosen.askable:
        _say_gzip(chosen.why)
    return [binary or find_apptainer(), "build", *chosen.options, *arguments]


@cache
def _say_gzip(why: str) -> None:
    """Once a process: its images are gzip only because the nodes were never asked."""
    log.warning(
        "images are made with gzip: %s; containers start about 100 ms sooner from zstd", why
    )


# Harbor's default: the host's home, /tmp and admin bind paths stay out of the container.
DEFAULT_NO_MOUNT = "home,tmp,bind-paths"


# What Apptainer says where the site's apptainer.conf refuses what a container's writable root
# needs: an overlay folder is a sandbox container to it (`allow container dir = no`), and
# overlays of any kind, --writable-tmpfs too, can be off (`enable overlay = no`).
SANDBOX_REFUSED = "configuration disallows users from running sandbox containers"
PATH_REFUSED = "is not in an allowed configured path"
OVERLAY_OFF = "requires 'enable overlay'"
OVERLAY_OFF_FIX = (
    "a container's root cannot be written, as every task's is under Docker: ask the cluster "
    "admins for `enable overlay = yes` in apptainer.conf"
)
_writable_in_memory = threading.Event()  # set once this node refused an overlay folder
# apptainer.conf's keys behind Apptainer's refusals, where its words do not name the key.
_POLICY_KEYS = {
    "disallows users from running sandbox containers": "allow container dir",
    "disallows users from running unencrypted SIF containers": "allow container sif",
    "disallows users from running extfs containers": "allow container extfs",
}
_SET_TO_NO = re.compile(r"requires '([a-z ]+)', but set to 'no' by administrator")


def site_policy_fix(said: str) -> str | None:
    """Where Apptainer's words `said` are a refusal by the site's apptainer.conf, what to ask
    the admins for (the key, set to yes); None otherwise."""
    if PATH_REFUSED in said:
        return (
            "this node's apptainer.conf runs images only from the folders its `limit container "
            "paths` names: keep the .sif store (cache_dir) in one of them, or ask the admins to "
            "add it"
        )
    named = _SET_TO_NO.search(said)
    key = named.group(1) if named else next((k for m, k in _POLICY_KEYS.items() if m in said), None)
    if key is None:
        return None
    return f"this node's apptainer.conf refuses it: ask the cluster admins for `{key} = yes`"


def refuses_overlay_folders(said: str) -> bool:
    """Whether Apptainer's words `said` are the site's refusal of an overlay folder; if so,
    containers of this process from now on write in memory (--writable-tmpfs)."""
    if SANDBOX_REFUSED not in said or "overlay" not in said:
        return False
    _writable_in_memory.set()
    return True


def writes_in_memory() -> bool:
    """Containers get --writable-tmpfs: this node's apptainer.conf refused overlay folders."""
    return _writable_in_memory.is_set()


def container_flags(
    *, overlay: Path | None, own_network: bool, no_mount: str = DEFAULT_NO_MOUNT
) -> list[str]:
    """The isolation a task's container gets, as Docker gives it: its own /tmp, /dev/shm and
    HOME from the image (nothing of the host's), a disk-backed writable root file system
    (`overlay`, a folder on scratch space; in memory, --writable-tmpfs, where the site allows no
    overlay folder; None: the image is a folder that is its own writable root, holder.py), its
    own process and IPC namespaces (so every process of the container, daemons included, stays
    in one tree), and with `own_network` a network namespace of its
    own, with only loopback until something connects it (network.py)."""
    if overlay is None:
        writable = ["--writable"]
    else:
        writable = ["--writable-tmpfs"] if writes_in_memory() else ["--overlay", str(overlay)]
    # --no-init: no Apptainer shim (`appinit`, its environ the engine's whole config) as the
    # pid namespace's PID 1; the command is, as a Docker container's is.
    flags = ["--contain", "--cleanenv", "--ipc", "--pid", "--no-init", *writable]
    for part in no_mount.split(","):
        if part.strip():
            flags += ["--no-mount", part.strip()]
    if own_network:
        flags += ["--net", "--network", "none"]
    return flags


# Apptainer's fakeroot command inside a namespace mapping the user alone (no subuid range): it
# fakes the image's other users, as Apptainer alone does for such a user (holder.py).
ONE_ID_FLAGS = ("--fakeroot",)


class Apptainer:
    """Apptainer (or Singularity) as the runtime: on the .sif with its own overlay, or nested in
    the holder's namespaces on a root of our own (`--writable`)."""

    name = "apptainer"
    own_root_only = False
    as_user = True
    fakes_other_ids = True
    writes_hostname = True

    def command(self, start: Start) -> list[str]:
        flags = (() if start.subids else ONE_ID_FLAGS) if start.own_root else start.flags
        return task_container_command(
            start.image,
            flags,
            start.command,
            overlay=None if start.own_root else start.overlay,
            own_network=start.own_network,
            no_mount=DEFAULT_NO_MOUNT if start.no_mount is None else start.no_mount,
            options=start.options,
        )


def task_container_command(
    sif: Path,
    flags: Sequence[str],
    command: Sequence[str],
    *,
    overlay: Path | None,
    own_network: bool,
    no_mount: str = DEFAULT_NO_MOUNT,
    options: Sequence[str] = (),
) -> list[str]:
    """`apptainer exec` of `command` in a task's container: `flags` from `run_flags`, the
    isolation of `container_flags`, then `options` (binds, --env). The environment starts every
    task this way and `harbor-hpc doctor` proves it works, so the two never drift apart."""
    return [
        find_apptainer(),
        "exec",
        *flags,
        *container_flags(overlay=overlay, own_network=own_network, no_mount=no_mount),
        "--pwd",
        "/",
        *options,
        str(sif),
        *command,
    ]
