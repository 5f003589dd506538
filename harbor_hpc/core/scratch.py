"""Private scratch folders, and what a killed process left of them.

Containers, builds and Ray nodes keep their files in 0700 folders of the node's temporary space:
overlays hold what a task installed, gigabytes on a /tmp that other users share. A process killed
outright (SIGKILL: Slurm's KillWait after a cancel, the OOM killer) cannot remove its folders,
so the next process of the user that makes one of the same kind there removes them. Each folder
holds a lock file that its maker keeps locked for the folder's life: a kernel lock, gone with its
process, so a lock that another process of the same node can take marks a folder whose owner
is gone. Only the node that made a folder judges it (its name is in the lock file): on a shared
filesystem whose locks are node-local, another node could take the lock of a folder in use.
Other users' folders are never entered (0700).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

from harbor_hpc.core.proc import run

LOCK = ".owner.lock"
_swept: set[tuple[str, Path]] = set()
_swept_guard = threading.Lock()
_logger = logging.getLogger(__name__)


def remove_private_dir(folder: Path) -> bool:
    """Remove a private folder; True when it is gone.

    Files the container's other users made in the overlay (apt's `_apt`, a task's `USER`) belong
    to the user's subordinate uids on the host, which only a user namespace holding the same
    mapping can delete: `unshare --map-auto` makes one without starting a container. A folder the
    kernel's overlay left unreadable (its `work/work`, mode 000) takes root of a namespace too.
    """
    shutil.rmtree(folder, ignore_errors=True)
    # With the user's ranges; without them (a user with none), root alone, who may still
    # enter the folders an overlay leaves unreadable (its work/work, mode 000).
    for ranges in (("--map-auto",), ()):
        if folder.exists() and shutil.which("unshare"):
            run(
                ["unshare", "--map-root-user", *ranges, "rm", "-rf", "--", str(folder)], timeout=300
            )
    return not folder.exists()


class PrivateDir:
    """A new 0700 folder named `prefix` `name`... in `root` (the temporary folder by default),
    locked as its owner's until `remove`. Making the first of a kind (`prefix`) in a process
    starts the removal of those whose owners are gone, in the background."""

    def __init__(self, prefix: str, root: Path | None = None, name: str = "") -> None:
        parent = Path(root) if root is not None else Path(tempfile.gettempdir())
        self.path = Path(tempfile.mkdtemp(prefix=prefix + name, dir=parent))
        # Locked before it has its name: a sweeper never sees it unlocked.
        unnamed = self.path / f"{LOCK}.new"
        self._lock = os.open(unnamed, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.write(self._lock, socket.gethostname().encode())
        os.rename(unnamed, self.path / LOCK)
        _sweep_once(prefix, parent)

    def remove(self) -> bool:
        """Remove the folder (True when it is gone), then let go of its lock."""
        try:
            return remove_private_dir(self.path)
        finally:
            with contextlib.suppress(OSError):
                os.close(self._lock)


def _sweep_once(prefix: str, parent: Path) -> None:
    with _swept_guard:
        if (prefix, parent) in _swept:
            return
        _swept.add((prefix, parent))
    threading.Thread(
        target=sweep, args=(prefix, parent), name="harbor-hpc-sweep", daemon=True
    ).start()


def sweep(prefix: str, parent: Path) -> list[Path]:
    """Remove the folders `prefix...` in `parent` whose owner is gone; the ones removed."""
    removed = []
    node = socket.gethostname().encode()
    for folder in sorted(parent.glob(f"{prefix}*")):
        try:
            fd = os.open(folder / LOCK, os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # another user's (0700), being made, or removed meanwhile
            continue
        try:
            # Another node's folder is for its own processes to judge.
            orphan = os.pread(fd, 4096, 0) == node
            if orphan:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner lives (or locks do not work here)
            orphan = False
        if not orphan:
            os.close(fd)
            continue
        try:
            # The lock file last: a sweep cut short leaves the folder to the next one.
            for entry in folder.iterdir():
                if entry.name != LOCK:
                    if entry.is_dir() and not entry.is_symlink():
                        remove_private_dir(entry)
                    else:
                        entry.unlink(missing_ok=True)
            (folder / LOCK).unlink()
            folder.rmdir()
            removed.append(folder)
        except Exception as exc:  # a leftover stays; the next sweep tries again
            _logger.debug("could not remove %s, left by a process gone: %s", folder, exc)
        finally:
            os.close(fd)
    if removed:
        _logger.info("removed %d folder(s) left in %s by processes gone", len(removed), parent)
    return removed
