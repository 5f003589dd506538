"""Atomic writes and inter-process file locks for files that users and jobs share.

Manifests, the .sif cache and run records live on shared filesystems and are touched by several
processes and nodes at once. Every write goes to a temporary file in the same folder and is renamed
into place, so a reader sees the old or the new content, never half of it. Locks are kernel locks
(`flock`): they vanish with the process that held them, so a crashed holder never blocks forever,
and they are honoured across NFS clients (Linux maps them to byte-range locks there).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

from harbor_hpc.core.errors import HarborHpcError, InputError


def _temp_beside(path: Path) -> tuple[int, str]:
    """A new temporary file in `path`'s folder (made if missing), open: (descriptor, name)."""
    try:
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _remove(tmp: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)


def _undo(tmps: list[str], exc: BaseException, path: Path) -> NoReturn:
    """Remove the temporary files `tmps`, then raise `exc`; an OSError that names no file (a
    full disk or quota surfaces in write(), which names none) is named after `path`."""
    for tmp in tmps:
        _remove(tmp)
    if isinstance(exc, OSError) and exc.filename is None:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    raise exc


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, Path]]:
    """A temporary file beside `path`, open (its descriptor) for the block to fill; renamed over
    `path` when the block ends, removed when it raises. The folder is made if it is missing."""
    fd, tmp = _temp_beside(path)
    try:
        try:
            yield fd, Path(tmp)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        _undo([tmp], exc, path)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` with `data` in one rename; keeps the old file's permissions unless `mode`."""
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
    with _replacing(path) as (fd, _):
        _write_all(fd, data)
        os.fsync(fd)
        os.fchmod(fd, mode)


class Replacements[K]:
    """Many files replaced at once, each as `atomic_write_bytes` replaces one (a reader sees the
    old file or the new, never half), with one wait for the disk for all of them.

    `stage` writes a group of new files beside the ones they replace (all of a group or none),
    from any thread; `commit` makes every staged file durable, then renames each into place.
    A fsync per file costs a disk flush each, which for thousands of task.toml files is most
    of the time; from `SYNC_EACH_BELOW` files on, each filesystem written is flushed once
    (`syncfs`) instead. What was staged but not renamed when the block ends is removed.
    """

    # Fewer files than this are flushed one by one: syncing a whole filesystem (what other
    # processes wrote to it as well) is worth it only for many.
    SYNC_EACH_BELOW = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._staged: dict[K, list[tuple[str, Path]]] = {}
        self._folders: dict[int, str] = {}  # a folder on each filesystem written (by device)
        self._closed = False

    def __enter__(self) -> Replacements[K]:
        return self

    def __exit__(self, *exc: object) -> None:
        # A thread may still be staging (Ctrl-C can leave a pool's thread unjoined): what it
        # stages from now on, it removes itself.
        with self._lock:
            self._closed = True
            left, self._staged = self._staged, {}
        for group in left.values():
            for tmp, _ in group:
                _remove(tmp)

    def stage(self, key: K, files: list[tuple[Path, bytes, int]]) -> None:
        """Write the new content of each (path, data, permissions) beside its path, as the
        group `key`. Raises OSError naming the file, having written none of the group."""
        if not files:
            return
        group: list[tuple[str, Path]] = []
        path = files[0][0]
        try:
            for path, data, mode in files:
                fd, tmp = _temp_beside(path)
                group.append((tmp, path))
                try:
                    _write_all(fd, data)
                    os.fchmod(fd, mode)
                    device = os.fstat(fd).st_dev
                finally:
                    os.close(fd)
                with self._lock:
                    self._folders.setdefault(device, str(path.parent))
        except BaseException as exc:
            _undo([tmp for tmp, _ in group], exc, path)
        with self._lock:
            if not self._closed:
                self._staged[key] = group
                return
        for tmp, _ in group:
            _remove(tmp)

    def commit(self) -> dict[K, OSError]:
        """Flush every staged file to disk, then rename each into place; the groups that could
        not be, with why (a group whose flush failed is left as it was; of a group whose rename
        failed, the files renamed before stay)."""
        with self._lock:
            keys = list(self._staged)
        failed: dict[K, OSError] = {}
        try:
            self._flush([tmp for key in keys for tmp, _ in self._staged[key]])
        except OSError as exc:
            failed = dict.fromkeys(keys, exc)
        for key in keys:
            for tmp, path in self._staged[key]:
                try:
                    if key not in failed:
                        os.replace(tmp, path)
                        continue
                except OSError as exc:  # the rest of the group stays as it was
                    failed[key] = OSError(exc.errno, exc.strerror, str(path))
                _remove(tmp)
            # Only now: stopped halfway through the group, the block's end removes the rest.
            with self._lock:
                del self._staged[key]
        return failed

    def _flush(self, names: list[str]) -> None:
        if len(names) < self.SYNC_EACH_BELOW:
            for name in names:
                fd = os.open(name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            return
        for folder in self._folders.values():
            _syncfs(folder)


def _syncfs(folder: str) -> None:
    """Flush everything written to the filesystem that holds `folder` (syncfs(2))."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), folder)
    finally:
        os.close(fd)


def atomic_copy(source: Path, path: Path) -> None:
    """Replace `path` with a copy of `source`, streamed (files can be gigabytes), in one rename;
    the copy gets the permissions of any new file (the user's umask)."""
    with _replacing(path) as (fd, tmp):
        shutil.copyfile(source, tmp)
        os.fchmod(fd, 0o666 & ~_umask())


def atomic_write_chunks(path: Path, chunks: Iterable[bytes], *, mode: int) -> None:
    """Replace `path` with `chunks`, written as they come (a file larger than memory), in one
    rename; nothing replaces it when the chunks' making raises."""
    with _replacing(path) as (fd, _):
        for chunk in chunks:
            _write_all(fd, chunk)
        os.fsync(fd)
        os.fchmod(fd, mode)


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), mode=mode)


def atomic_write_json(path: Path, data: Any, *, mode: int | None = None) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n", mode=mode)


def read_small(path: str) -> tuple[bytes, os.stat_result]:
    """A small file's bytes (a link followed) and its status, through one descriptor: no
    buffered file object, which costs more than the read for the many small files of a dataset."""
    fd = os.open(path, os.O_RDONLY)
    try:
        info = os.fstat(fd)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks), info


def text_of(data: bytes, errors: str = "strict") -> str:
    """Bytes as a text file reads them (`Path.read_text`): UTF-8, every kind of newline "\\n"."""
    return data.decode(errors=errors).replace("\r\n", "\n").replace("\r", "\n")


def read_bytes(path: str | Path) -> bytes:
    """A file's bytes through one descriptor and nothing else: on a shared filesystem each
    call on a path is a round trip, and a run's bookkeeping reads tens of thousands of files."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_json(path: Path) -> Any:
    """Parse a JSON file, naming the file when it is missing or malformed."""
    try:
        return json.loads(read_bytes(path))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:  # a folder given for a file, no permission: the user's to fix
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from None


# How many reads of a run's small files go at once: a shared filesystem answers many round trips
# at a time, so that tens of thousands of files are read in the time of a fraction of them.
READERS = 16


def read_in_threads[Item, Read](
    read: Callable[[Item], Read], items: Iterable[Item]
) -> Iterator[Read]:
    """`read(item)` of each of `items`, in their order, READERS at a time; at most a few times
    READERS read ahead of the one taken, so that what is read is never all held at once."""
    with ThreadPoolExecutor(READERS, thread_name_prefix="harbor-hpc-read") as pool:
        ahead: deque[Future[Read]] = deque()
        for item in items:
            ahead.append(pool.submit(read, item))
            if len(ahead) >= 4 * READERS:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


class LockTimeout(HarborHpcError):
    """Another process held the lock longer than the caller would wait."""


@contextlib.contextmanager
def file_lock(
    path: Path, *, timeout: float | None = None, poll: float = 0.1, mode: int | None = None
) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if needed) for the `with` block.

    The holder writes `host:pid` into the file so that a waiter that gives up can say who holds it.
    `mode` is given to a lock file this process owns (e.g. group-writable, in a folder a lab
    shares); another user's lock file that this user may only read is locked read-only, which
    local filesystems allow.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_lock(path, mode)
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    holder = path.read_text(errors="replace").strip() or "another process"
                    raise LockTimeout(
                        f"{path}: still locked by {holder} after {timeout:.0f} s",
                        hint="wait for that process to finish, or remove the lock file if it "
                        "is gone",
                    ) from None
                time.sleep(poll)
            except OSError as exc:  # NFS locks only files opened for writing
                raise HarborHpcError(
                    f"{path}: cannot lock it ({exc.strerror})",
                    hint="ask its owner to make it writable for you (chmod g+w), or to remove it",
                ) from None
        _say_holder(fd, f"{socket.gethostname()}:{os.getpid()}\n")
        try:
            yield
        finally:
            _say_holder(fd, "")
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def held_by_another(path: Path) -> bool:
    """Whether another process holds `file_lock(path)` now (asked without taking it, or making
    it): not this one, which the holder's `host:pid` in the file tells."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        held = True
    except OSError:
        held = False
    else:
        held = False
    finally:
        os.close(fd)
    if not held:
        return False
    with contextlib.suppress(OSError):
        return path.read_text().strip() != f"{socket.gethostname()}:{os.getpid()}"
    return True


def _open_lock(path: Path, mode: int | None) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        try:
            return os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise HarborHpcError(
                f"{path}: cannot open this lock file ({exc.strerror})",
                hint="use a folder you can write, or ask the lock file's owner to remove it",
            ) from None
    if mode is not None and os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, mode)
    return fd


def _say_holder(fd: int, text: str) -> None:
    """Write who holds the lock into it; a lock opened read-only stays silent."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` is on, from /proc/mounts (empty when unknown)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    real, best, kind = str(path.resolve()), "", ""
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind
