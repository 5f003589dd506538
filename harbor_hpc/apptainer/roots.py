"""Images unpacked on the node's own disk (`unpacked_roots`, opt-in): a container starts from the
folder some four times as fast as from the .sif.

From a .sif, Apptainer (unprivileged) mounts the image with squashfuse and must stack the
writable overlay on it with fuse-overlayfs: every file the container opens is a round trip
through two FUSE daemons. From a folder on a local disk it uses the kernel's overlayfs. Each
image is unpacked once per node and user, into a 0700 folder of the node's temporary space,
and shared by that user's containers there; the least recently used roots that no container
uses are removed once they hold more than the cap.

The image is unpacked as root of a user namespace mapped as Apptainer's fakeroot maps its
containers' (`unshare --map-root-user --map-auto`), so every file keeps its owner: only
fakeroot containers (the default) run from unpacked roots. Device nodes are not made (Apptainer
gives every container a /dev of its own). Whatever cannot be unpacked (no `unshare --map-auto`,
no subordinate ids, a full disk) runs from its .sif, as always.

Each root has, beside it, `KEY.use`: a container holds a shared lock on it while it runs from
the root, and its modification time says when the root was last used. A root is removed only
under an exclusive lock on it, and a lease checks, once it has its lock, that the file it locked
is still the one of that name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harbor_hpc.apptainer.sif import RootPartition, root_partition
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import file_lock
from harbor_hpc.core.proc import run
from harbor_hpc.core.scratch import remove_private_dir

log = logging.getLogger(__name__)

UNPACK_TIMEOUT_S = 1800
# unsquashfs's complaints that are no loss: Apptainer mounts a /dev of its own.
_DEVICE_NODE = re.compile(r"(could not|failed to) create (character|block) device")
# After a failed unpack, the image runs from its .sif this long before it is tried again.
RETRY_AFTER_S = 600
# unsquashfs as root of a user namespace mapped as Apptainer's fakeroot maps it (root the user,
# 1 and up the user's subordinate ids): every file keeps the owner the image gave it.
UNPACK_AS_ROOT = ("unshare", "--map-root-user", "--map-auto")
# Room an unpack needs, in multiples of the compressed image.
_GROWTH = 4


@dataclass
class Lease:
    """A container's use of an unpacked root, until `release`."""

    root: Path
    _fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class UnpackedRoots:
    """This user's unpacked roots in `folder` (made 0700), at most `cap_bytes` of them beside
    the ones in use."""

    def __init__(self, folder: Path, cap_bytes: int) -> None:
        self.folder = folder
        self.cap_bytes = cap_bytes

    @classmethod
    def on_node(cls, scratch: Path | None, cap_gib: float) -> UnpackedRoots:
        """The roots of this user in `scratch` (the node's temporary folder by default)."""
        parent = scratch if scratch is not None else Path(tempfile.gettempdir())
        return cls(parent / f"harbor-hpc-roots-{os.getuid()}", int(cap_gib * (1 << 30)))

    def lease(self, sif: Path) -> Lease | None:
        """The unpacked root of `sif`, held until released; None when it runs from the .sif
        (not a squashfs SIF, or the unpack failed: logged, and not tried again for a while)."""
        try:
            return self._lease(sif)
        except (OSError, HarborHpcError) as exc:  # a full disk, a lock held for too long
            log.warning("unpacked roots: %s: %s: the .sif is used", sif, exc)
            return None

    def _lease(self, sif: Path) -> Lease | None:
        partition = root_partition(sif)
        if partition is None or not self._ours():
            return None
        stat = sif.stat()
        key = hashlib.sha256(
            f"{sif.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
        ).hexdigest()[:32]
        root = self.folder / key
        failed = self.folder / f"{key}.failed"
        with contextlib.suppress(FileNotFoundError):
            if time.time() - failed.stat().st_mtime < RETRY_AFTER_S:
                return None
        for _ in range(5):
            fd = self._hold(key)
            if fd is None:
                continue  # removed while we waited for it: again
            try:
                with file_lock(self.folder / f".{key}.lock", timeout=UNPACK_TIMEOUT_S):
                    if not root.is_dir() and not self._unpack(sif, partition, key):
                        with contextlib.suppress(OSError):
                            failed.touch()
                        os.close(fd)
                        return None
                os.utime(self.folder / f"{key}.use")
            except BaseException:
                os.close(fd)
                raise
            return Lease(root, fd)
        return None

    def _ours(self) -> bool:
        """Make the folder (0700); False when it is not this user's own."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            status = self.folder.lstat()
        except OSError as exc:
            log.warning("unpacked roots: cannot use %s (%s): the .sif is used", self.folder, exc)
            return False
        if status.st_uid != os.getuid() or status.st_mode & 0o077 or self.folder.is_symlink():
            log.warning("unpacked roots: %s is not this user's private folder", self.folder)
            return False
        return True

    def _hold(self, key: str) -> int | None:
        """A shared lock on the root's use file, or None when the file was replaced meanwhile."""
        path = self.folder / f"{key}.use"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
        return None

    def _unpack(self, sif: Path, partition: RootPartition, key: str) -> bool:
        self._make_room(partition.size * _GROWTH, keep=key)
        partial = self.folder / f".{key}.partial"  # what a killed unpack left goes first
        remove_private_dir(partial)
        done = run(
            [
                *UNPACK_AS_ROOT,
                *("unsquashfs", "-q", "-n", "-no-xattrs", "-d", str(partial)),
                *("-o", str(partition.offset), str(sif)),
            ],
            timeout=UNPACK_TIMEOUT_S,
        )
        errors = [line for line in done.stderr.splitlines() if line.strip()]
        if done.error or (
            done.returncode != 0 and not all(_DEVICE_NODE.search(line) for line in errors)
        ):
            log.warning("unpacked roots: cannot unpack %s (%s): the .sif is used", sif, done.why())
            remove_private_dir(partial)
            return False
        size = sum(
            os.lstat(os.path.join(folder, name)).st_size
            for folder, dirs, files in os.walk(partial)
            for name in dirs + files
        )
        (self.folder / f"{key}.size").write_text(str(size))
        os.rename(partial, self.folder / key)
        return True

    def _make_room(self, need: int, *, keep: str) -> None:
        """Remove the least recently used roots no container uses until `need` more bytes fit
        under the cap."""
        sizes = {}
        for path in self.folder.glob("*.size"):
            with contextlib.suppress(OSError, ValueError):
                sizes[path.name.removesuffix(".size")] = int(path.read_text())
        total = sum(sizes.values())

        def last_used(key: str) -> float:
            try:
                return (self.folder / f"{key}.use").stat().st_mtime
            except OSError:
                return 0.0

        for key in sorted(sizes, key=last_used):
            if total + need <= self.cap_bytes:
                return
            if key != keep and self._remove_unused(key):
                total -= sizes[key]

    def _remove_unused(self, key: str) -> bool:
        """Remove the root `key` if no container uses it; True when it is gone."""
        fd = os.open(self.folder / f"{key}.use", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            if not remove_private_dir(self.folder / key):
                return False
            log.info("unpacked roots: removed %s, used least recently", key)
            # The use file last: a lease waiting on it then finds it gone, and starts again.
            for name in (f"{key}.size", f"{key}.use"):
                with contextlib.suppress(FileNotFoundError):
                    (self.folder / name).unlink()
            return True
        finally:
            os.close(fd)
