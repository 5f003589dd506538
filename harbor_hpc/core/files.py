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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harbor_hpc.core.errors import HarborHpcError, InputError


@contextlib.contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, Path]]:
    """A temporary file beside `path`, open (its descriptor) for the block to fill; renamed over
    `path` when the block ends, removed when it raises. The folder is made if it is missing."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            yield fd, Path(tmp)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:
            # A full disk or quota surfaces in write(), which names no file: name it.
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace `path` with `data` in one rename; keeps the old file's permissions unless `mode`."""
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
    with _replacing(path) as (fd, _):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.fchmod(fd, mode)


def atomic_copy(source: Path, path: Path) -> None:
    """Replace `path` with a copy of `source`, streamed (files can be gigabytes), in one rename;
    the copy gets the permissions of any new file (the user's umask)."""
    with _replacing(path) as (fd, tmp):
        shutil.copyfile(source, tmp)
        os.fchmod(fd, 0o666 & ~_umask())


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), mode=mode)


def atomic_write_json(path: Path, data: Any, *, mode: int | None = None) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n", mode=mode)


def read_json(path: Path) -> Any:
    """Parse a JSON file, naming the file when it is missing or malformed."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    except OSError as exc:  # a folder given for a file, no permission: the user's to fix
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from None


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
