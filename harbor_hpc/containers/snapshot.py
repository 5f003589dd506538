"""Snapshots of a live container's filesystem, for forks and restores (issue 58).

A container's root of our own (holder.py) is the kernel's overlay: the image below, everything
the episode changed in one upper folder. A snapshot is a copy of that upper, taken while the
container's processes are stopped (SIGSTOP, so no write lands half-way), in a private folder
of its own on the scratch disk. A container restored from it (a fork's child, `restore`) mounts
its root with the snapshot as a lower layer between its own empty upper and the image: the
overlay reads the copy's whiteouts and opaque folders as it reads an image layer's, so the
child sees the parent's files at that moment, and its writes go to its own upper. n children
share one copy: a fork of n costs one copy and n starts.

A snapshot of a restored container copies its upper alone: it lies above the snapshot it was
restored from (`layers`), which it keeps. A snapshot's folder is removed once nobody holds it
(its handle and every container mounted over it, `hold` / `release`); a process killed
outright leaves it to the next one's sweep (core/scratch.py). What was copied is bounded per
process by `snapshot_storage_mb`. Processes, /dev/shm and the binds (Harbor's log folders)
are not part of it: a child starts its own processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from harbor.environments.base import BaseEnvironment
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.containers.errors import SnapshotRefused
from harbor_hpc.containers.watchdog import process_tree
from harbor_hpc.core.proc import run
from harbor_hpc.core.scratch import PrivateDir

PREFIX = "harbor-hpc-snapshot-"
# A copy of gigabytes takes its time; the container stays stopped meanwhile.
COPY_TIMEOUT_S = 1800.0

_held_bytes = 0
_held_lock = threading.Lock()
# This process's snapshots, by folder, while held (`restore_from` names one).
_live: dict[Path, Snapshot] = {}


@dataclass(frozen=True)
class Restorable:
    """A snapshot as the kwargs that start an environment of the same class from it (local or
    on a Ray node), held until `release` is awaited: what `Sandbox.fork` asks an environment
    for."""

    kwargs: dict[str, Any]
    release: Callable[[], Awaitable[None]]


class Snapshot:
    """A copy of a container's upper (`upper`), above the snapshot that container was
    restored from (`below`), while held."""

    def __init__(
        self, scratch: Path, below: Snapshot | None, source: Path, step: int | None = None
    ) -> None:
        self._folder = PrivateDir(PREFIX, scratch)
        # The trial folder of the container it was taken from, and the step of its episode
        # (the caller's count), which a restored container's trial records (branch.py).
        self.source = source
        self.step = step
        self.upper = self._folder.path / "upper"
        self.upper.mkdir()
        self.below = below
        if below is not None:
            below.hold()
        self.bytes = 0
        # What the container's setup.sh exported (a child runs it no more: its files are here).
        self.env: dict[str, str] = {}
        self._holders = 1  # its handle
        self._lock = threading.Lock()
        with _held_lock:
            _live[self.path] = self

    @property
    def path(self) -> Path:
        return self._folder.path

    @property
    def layers(self) -> list[Path]:
        """The lower layers a container restored from it mounts above its image, topmost first."""
        below = self.below.layers if self.below is not None else []
        return [self.upper, *below]

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise SnapshotRefused(f"the snapshot {self.path} was removed")
            self._holders += 1

    def release(self) -> None:
        """One holder less; the last one removes the folder (and lets go of `below`)."""
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            with _held_lock:
                _live.pop(self.path, None)
            self._folder.remove()
            _count(-self.bytes)
            if self.below is not None:
                self.below.release()


def branch_record(snapshot: Snapshot) -> dict[str, Any]:
    """Where a container restored from `snapshot` branched: the trial it was taken in, and
    the step of that episode (branch.py's record in its trial folder)."""
    return {"parent_trial": str(snapshot.source), "step": snapshot.step}


def fork_trial(trial_paths: TrialPaths, session_id: str) -> tuple[TrialPaths, str]:
    """A fork's child's trial folder, made beside its parent's (`TRIAL.fork-ID`), and its
    session id."""
    fork = f"fork-{uuid.uuid4().hex[:8]}"
    trial = trial_paths.trial_dir
    paths = TrialPaths(trial.with_name(f"{trial.name}.{fork}"))
    paths.mkdir()
    return paths, f"{session_id}.{fork}"


async def started_all[E: BaseEnvironment](children: list[E]) -> list[E]:
    """`children` started side by side; where one fails, all stopped and its error raised."""
    started = await asyncio.gather(
        *(child.start(force_build=False) for child in children), return_exceptions=True
    )
    failed = [result for result in started if isinstance(result, BaseException)]
    if failed:
        await asyncio.gather(
            *(child.stop(delete=True) for child in children), return_exceptions=True
        )
        raise failed[0]
    return children


def live_snapshot(path: Path) -> Snapshot:
    """The snapshot of this process at `path`, held once more (the caller releases it)."""
    with _held_lock:
        snapshot = _live.get(Path(path))
    if snapshot is None:
        raise SnapshotRefused(
            f"{path} is no snapshot this process holds (a snapshot is restored in the process, "
            "and on the node, that took it, while its handle or a container restored from it "
            "holds it)"
        )
    snapshot.hold()
    return snapshot


def _count(delta: int) -> None:
    global _held_bytes
    with _held_lock:
        _held_bytes += delta


def held_bytes() -> int:
    """What this process's snapshots hold on disk."""
    with _held_lock:
        return _held_bytes


@contextlib.contextmanager
def stopped(root_pid: int, server_pid: int) -> Iterator[None]:
    """Every process of the container (of the tree at `root_pid`, in the pid namespace of its
    command server `server_pid`) stopped (SIGSTOP) meanwhile; those it stopped go on after (one
    the container had stopped itself stays so). The runtime's processes above the container
    (nsenter, Apptainer's starter, unshare) go on: nsenter stops itself when its child does,
    and would stay so."""
    paused: list[psutil.Process] = []
    seen: set[int] = set()
    namespace = _pid_namespace(server_pid)
    try:
        # Again until no new process appears: one forked meanwhile is stopped too.
        while fresh := [pid for pid in process_tree(root_pid) if pid not in seen]:
            seen.update(fresh)
            for pid in fresh:
                with contextlib.suppress(psutil.Error):
                    process = psutil.Process(pid)
                    inside = _pid_namespace(pid) == namespace
                    if inside and process.status() != psutil.STATUS_STOPPED:
                        process.send_signal(signal.SIGSTOP)
                        paused.append(process)
        yield
    finally:
        for process in paused:
            with contextlib.suppress(psutil.Error):
                process.send_signal(signal.SIGCONT)


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def upper_bytes(enter: list[str], upper: Path) -> int:
    """What the upper folder `upper` holds (`du`, run where its files can be read: `enter`)."""
    done = run([*enter, "du", "-s", "-B1", "--", str(upper)], timeout=COPY_TIMEOUT_S)
    if not done.ok:
        raise SnapshotRefused(f"cannot measure {upper}: {done.why()}")
    return int(done.stdout.split()[0])


def copy_upper(enter: list[str], upper: Path, snapshot: Snapshot, limit_bytes: int | None) -> None:
    """Copy the container's `upper` into `snapshot` (`enter`: the holder's namespaces, where
    its owners and the overlay's xattrs and whiteouts can be made), within `limit_bytes` for
    all of this process's snapshots."""
    size = upper_bytes(enter, upper)
    _admit("its upper", size, limit_bytes)
    done = run(
        [*enter, "cp", "-a", "--reflink=auto", "--", f"{upper}/.", f"{snapshot.upper}/"],
        timeout=COPY_TIMEOUT_S,
    )
    if not done.ok:
        raise SnapshotRefused(f"copying {upper} failed: {done.why()}")
    snapshot.bytes = size
    _count(size)


def _admit(what: str, size: int, limit_bytes: int | None) -> None:
    """Refuse `what` (`size` bytes more) where this process's snapshots would then hold more
    than `limit_bytes` (snapshot_storage_mb)."""
    if limit_bytes is not None and held_bytes() + size > limit_bytes:
        raise SnapshotRefused(
            f"{what} holds {size / 2**20:.1f} MB, and this process's snapshots "
            f"{held_bytes() / 2**20:.1f} MB of snapshot_storage_mb={limit_bytes // 2**20}: "
            "remove snapshots no longer needed, or raise snapshot_storage_mb"
        )


# tar keeping what the overlay's upper holds: owners by number, modes, the overlay's xattrs
# (user.overlay.*: opaque folders), whiteouts (character devices 0/0).
_TAR = ("tar", "--numeric-owner", "--xattrs", "--xattrs-include=*")


def _as_owner(subids: bool) -> list[str]:
    """A user namespace mapping the ids a container's files have (holder.py's)."""
    return ["unshare", "--map-root-user", *(("--map-auto",) if subids else ())]


def pack_layers(snapshot: Snapshot, archives: list[Path], subids: bool) -> None:
    """Each of `snapshot`'s layers (topmost first) as a tar at each of `archives`, to copy it
    to another node (`unpack_layers` there)."""
    for layer, archive in zip(snapshot.layers, archives, strict=True):
        done = run(
            [*_as_owner(subids), *_TAR, "-C", str(layer), "-cf", str(archive), "."],
            timeout=COPY_TIMEOUT_S,
        )
        if not done.ok:
            raise SnapshotRefused(f"packing {layer} failed: {done.why()}")


def unpack_layers(
    archives: list[Path],
    scratch: Path,
    *,
    source: Path,
    step: int | None,
    env: dict[str, str],
    subids: bool,
    limit_bytes: int | None,
) -> Snapshot:
    """The snapshot whose layers `pack_layers` made (topmost first), made anew in `scratch`,
    counted with this process's snapshots within `limit_bytes` (snapshot_storage_mb)."""
    below: Snapshot | None = None
    try:
        for archive in reversed(archives):  # the image's nearest first
            layer = Snapshot(scratch, below, source, step)
            if below is not None:
                below.release()  # `layer` holds it
            below = layer
            done = run(
                [*_as_owner(subids), *_TAR, "-xpf", str(archive), "-C", str(layer.upper)],
                timeout=COPY_TIMEOUT_S,
            )
            if not done.ok:
                raise SnapshotRefused(f"unpacking a copied snapshot failed: {done.why()}")
            size = upper_bytes(_as_owner(subids), layer.upper)
            _admit("its copy on this node", size, limit_bytes)
            layer.bytes = size
            _count(size)
    except BaseException:
        if below is not None:
            below.release()
        raise
    assert below is not None
    below.env = env
    return below
