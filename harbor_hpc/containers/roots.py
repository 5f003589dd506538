"""Images unpacked on the node's own disk: the lower folders of containers' own roots (holder.py).

A container's root is an overlay mounted in the environment's own namespaces, over the .sif's
squashfs (through squashfuse: every file the container opens a round trip through its FUSE
daemon) or over the image unpacked in a folder of the node's disk (the kernel's speed). With
`unpacked_roots = "auto"` (the default) an image is unpacked where it pays: once it starts a
second time on the node (an RL trainer restarts the same few images thousands of times), in the
background, its starts going on from the .sif meanwhile (none waits for the unpack); on a disk,
never a tmpfs; never past a quarter of the disk's free space (what the roots hold counted in).
An image started once costs nothing but a mark. `unpacked_roots = N` (GiB) unpacks at an
image's first start and keeps up to N GiB; 0 never unpacks.

Each image is unpacked once per node and user, into a 0700 folder of the node's temporary space,
and shared by that user's containers there; the least recently used roots that no container
uses are removed once they hold more than the cap.

The image is unpacked as root of a user namespace mapped as the holder's (`unshare
--map-root-user --map-auto`), so every file keeps its owner. Device nodes are not made
(Apptainer gives every container a /dev of its own). Whatever cannot be unpacked (no subordinate
ids, a full disk) runs from its .sif, as always.

Each root has, beside it, `KEY.use`: a container holds a shared lock on it while it runs from
the root, and its modification time says when the root was last used. A root is removed only
under an exclusive lock on it, and a lease checks, once it has its lock, that the file it locked
is still the one of that name. A root is made as `.KEY.partial` under the lock `.KEY.lock`, and
renamed into place: what a killed unpack left (its lock free again) goes at the next unpack.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harbor_hpc.containers.sif import RootPartition, root_partition
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import file_lock, filesystem_type
from harbor_hpc.core.proc import run
from harbor_hpc.core.scratch import remove_private_dir

log = logging.getLogger(__name__)

UNPACK_TIMEOUT_S = 1800
# unsquashfs's complaints that are no loss: Apptainer mounts a /dev of its own.
_DEVICE_NODE = re.compile(r"(could not|failed to) create (character|block) device")
# After a failed unpack, the image runs from its .sif this long before it is tried again.
RETRY_AFTER_S = 600
# unsquashfs as root of a user namespace mapped as the holder's (root the user, 1 and up the
# user's subordinate ids): every file keeps the owner the image gave it.
UNPACK_AS_ROOT = ("unshare", "--map-root-user", "--map-auto")
# Room an unpack needs, in multiples of the compressed image.
_GROWTH = 4
# "auto": the roots hold at most this share of their disk's free space (theirs counted in).
AUTO_SHARE = 0.25
GIB = 1 << 30

# The roots this process is unpacking in the background (their folders: an image's key is the
# same in every roots folder), one thread each.
_unpacking: set[Path] = set()
_unpacking_lock = threading.Lock()


@dataclass
class Lease:
    """A container's use of an unpacked root, until `release`."""

    root: Path
    _fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class UnpackedRoots:
    """This user's unpacked roots in `folder` (made 0700): at most `cap_bytes` of them beside
    the ones in use, each unpacked at its image's first lease; or, with no cap ("auto"), at
    most AUTO_SHARE of the disk's free space, each unpacked in the background from its image's
    second lease on the node (the leases before it run from the .sif)."""

    def __init__(self, folder: Path, cap_bytes: int | None) -> None:
        self.folder = folder
        self.cap_bytes = cap_bytes

    @classmethod
    def on_node(cls, scratch: Path | None, cap: float | str) -> UnpackedRoots | None:
        """The roots of this user in `scratch` (the node's temporary folder by default), `cap`
        GiB of them or "auto"; None where there are none: `cap` 0, or "auto" on a tmpfs."""
        parent = scratch if scratch is not None else Path(tempfile.gettempdir())
        folder = parent / f"harbor-hpc-roots-{os.getuid()}"
        if cap == "auto":
            return None if filesystem_type(parent) == "tmpfs" else cls(folder, None)
        return cls(folder, int(float(cap) * GIB)) if float(cap) > 0 else None

    def lease(self, sif: Path) -> Lease | None:
        """The unpacked root of `sif`, held until released; None when it runs from the .sif
        (not a squashfs SIF, or the unpack failed: logged, and not tried again for a while)."""
        try:
            return self._lease(sif)
        except (OSError, HarborHpcError) as exc:  # a full disk, a lock held for too long
            log.warning("unpacked roots: %s: %s: the .sif is used", sif, exc)
            return None

    @staticmethod
    def _key(sif: Path) -> str:
        """The root's name: the image's path, size and time (a new image, a new root)."""
        stat = sif.stat()
        return hashlib.sha256(
            f"{sif.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
        ).hexdigest()[:32]

    def _lease(self, sif: Path) -> Lease | None:
        partition = root_partition(sif)
        if partition is None or not self._ours():
            return None
        key = self._key(sif)
        root = self.folder / key
        failed = self.folder / f"{key}.failed"
        with contextlib.suppress(FileNotFoundError):
            if time.time() - failed.stat().st_mtime < RETRY_AFTER_S:
                return None
        if self.cap_bytes is None and not root.is_dir():
            self._unpack_later(sif, partition, key)
            return None
        for _ in range(5):
            fd = self._hold(key)
            if fd is None:
                continue  # removed while we waited for it: again
            try:
                with file_lock(self.folder / f".{key}.lock", timeout=UNPACK_TIMEOUT_S):
                    if not root.is_dir():
                        # "auto" never unpacks here (removed meanwhile): the .sif this time.
                        unpacked = self.cap_bytes is not None and self._unpack(sif, partition, key)
                        if not unpacked:
                            if self.cap_bytes is not None:
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

    def _unpack_later(self, sif: Path, partition: RootPartition, key: str) -> None:
        """ "auto": the image's first lease on the node only marks it seen; a later one
        unpacks it in a thread of its own, under the root's lock (one unpack on the node)."""
        seen = self.folder / f"{key}.seen"
        if not seen.exists():
            seen.touch()
            return
        with _unpacking_lock:
            if self.folder / key in _unpacking:
                return
            _unpacking.add(self.folder / key)
        threading.Thread(
            target=self._unpack_in_background,
            args=(sif, partition, key),
            name=f"harbor-hpc-unpack-{key[:8]}",
            # Not a daemon: a process that ends meanwhile (a Slurm element after its one trial)
            # waits for the unpack, else each would start it again and leave it half done.
            daemon=False,
        ).start()

    def _unpack_in_background(self, sif: Path, partition: RootPartition, key: str) -> None:
        try:
            with file_lock(self.folder / f".{key}.lock", timeout=UNPACK_TIMEOUT_S):
                if (self.folder / key).is_dir():
                    return  # another process of the node's made it meanwhile
                began = time.monotonic()
                if self._unpack(sif, partition, key):
                    (self.folder / f"{key}.use").touch()  # used now: last to go
                    log.info(
                        "unpacked roots: %s unpacked for its next starts (%.1f s)",
                        sif,
                        time.monotonic() - began,
                    )
                else:
                    (self.folder / f"{key}.failed").touch()
        except (OSError, HarborHpcError) as exc:
            log.warning("unpacked roots: %s: %s: it runs from its .sif", sif, exc)
        finally:
            with _unpacking_lock:
                _unpacking.discard(self.folder / key)

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
        if not self._make_room(partition.size * _GROWTH, keep=key):
            log.info("unpacked roots: no room for %s under the roots' cap: its .sif", sif)
            return False
        self._remove_partials()
        partial = self.folder / f".{key}.partial"  # what a killed unpack of this one left
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

    def _remove_partials(self) -> None:
        """Remove what killed unpacks of other images left: `.KEY.partial` folders whose lock
        nobody holds (a partial being made keeps its lock held; so does this unpack's own)."""
        for partial in self.folder.glob(".*.partial"):
            with self._lock_free(partial.name[1:].removesuffix(".partial")) as free:
                if free:  # else being made now
                    remove_private_dir(partial)

    @contextlib.contextmanager
    def _lock_free(self, key: str) -> Iterator[bool]:
        """Whether nobody holds the lock of root `key` (held while the root is made; a killed
        unpack's is free again), held by this process for the block when it was free."""
        try:
            fd = os.open(self.folder / f".{key}.lock", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no lock file: nothing is being made
            yield True
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            yield True
        finally:
            os.close(fd)

    def _make_room(self, need: int, *, keep: str) -> bool:
        """Remove the least recently used roots no container uses until `need` more bytes fit
        under the cap. Whether they fit; a cap in GiB may be passed (the roots in use stay) by
        an image within it, the share of the disk ("auto") never."""
        sizes = {}
        for path in self.folder.glob("*.size"):
            with contextlib.suppress(OSError, ValueError):
                sizes[path.name.removesuffix(".size")] = int(path.read_text())
        total = sum(sizes.values())
        cap = self.cap_bytes
        if cap is None:
            cap = int((shutil.disk_usage(self.folder).free + total) * AUTO_SHARE)

        def last_used(key: str) -> float:
            try:
                return (self.folder / f"{key}.use").stat().st_mtime
            except OSError:
                return 0.0

        for key in sorted(sizes, key=last_used):
            if total + need <= cap:
                return True
            if key != keep and self._remove_unused(key):
                total -= sizes[key]
        # Past a cap in GiB only by the roots in use; an image bigger than the cap never.
        return total + need <= cap or (self.cap_bytes is not None and need <= cap)

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
