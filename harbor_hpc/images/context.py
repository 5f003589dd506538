"""The identity of a build context: a hash of exactly what Docker would send and build from.

The file list comes from docker-py's own `.dockerignore` matcher (the `PatternMatcher` that
`exclude_paths` walks with to make the tar `build` sends), walked as `exclude_paths` walks, so the
hash and the build can never disagree about which files count.
Each entry contributes its relative path, its type and permission bits (COPY keeps them) and its
content (a symlink: its target text, as Docker sends links unfollowed). Owners and mtimes are left
out: COPY resets owners to root, and mtimes differ between unpackings of identical tasks. The
Dockerfile is also hashed by its resolved content, because a Dockerfile that is a symlink to a file
outside the context is sent by content. Build args the Dockerfile declares come last, sorted, so
one context built with other build args is another image; without any, nothing is added and the
hash is the one images were named by before build args existed.

Identical files in many tasks (a dataset unpacked with hard links, or a rerun in one process) are
read once, by (device, inode, mtime, size).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import os
import posixpath
import stat
import threading
from collections.abc import Mapping
from pathlib import Path

from harbor_hpc.core.files import read_small
from harbor_hpc.images.dockerfile import escapes_context, is_glob

DOCKERFILE = "Dockerfile"
DOCKERIGNORE = ".dockerignore"
_HASH_VERSION = b"harbor-hpc-context-v1\n"
# Bytes read at a time from a file being hashed.
_CHUNK = 1 << 20


def dockerignore_patterns(context: Path, digests: FileDigests | None = None) -> list[str]:
    """The `.dockerignore` patterns, read as docker-py's `build` reads them (through `digests`,
    which then knows the file's digest)."""
    path = os.path.join(context, DOCKERIGNORE)
    try:
        text = (digests.read(path) if digests else read_small(path)[0]).decode()
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip() and line.strip()[0] != "#"]


def context_files(context: Path, digests: FileDigests | None = None) -> list[str]:
    """Relative paths (files, folders, links) that Docker sends for `context`, sorted.

    The walk of docker-py's `exclude_paths`, entry for entry, with its own `PatternMatcher`
    deciding what is ignored; only faster: one `scandir` per folder, and each path's verdict
    remembered per set of patterns, as tasks of a dataset share their files' names.
    """
    ignored = _ignored(tuple(dockerignore_patterns(context, digests)))
    found: list[str] = []
    folders = [(str(context), "")]
    while folders:
        folder, prefix = folders.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = prefix + entry.name
                skip = ignored(rel)
                if not skip:
                    found.append(rel)
                # A folder is entered unless it is a link, or ignored with no `!` pattern
                # that re-includes something under it.
                if entry.is_dir(follow_symlinks=False) and (not skip or ignored.reincludes(rel)):
                    folders.append((entry.path, rel + "/"))
    return sorted(found)


class _Ignored:
    """docker-py's verdict on each path for one `.dockerignore`, each path asked once."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        from docker.utils.build import PatternMatcher  # docker-py loads when a context is hashed

        # As `exclude_paths` makes it: the Dockerfile is always sent.
        self._matcher = PatternMatcher([*patterns, f"!{DOCKERFILE}"])
        self._verdicts: dict[str, bool] = {}

    def __call__(self, rel: str) -> bool:
        verdict = self._verdicts.get(rel)
        if verdict is None:
            if len(self._verdicts) >= _VERDICTS:
                self._verdicts.clear()
            verdict = self._verdicts[rel] = bool(self._matcher.matches(rel))
        return verdict

    def reincludes(self, folder: str) -> bool:
        """Whether a `!` pattern names something under the ignored `folder` (docker-py then
        walks into it)."""
        return any(
            pattern.exclusion and pattern.cleaned_pattern.startswith(folder)
            for pattern in self._matcher.patterns
        )


# Paths whose verdicts one `_Ignored` keeps at most.
_VERDICTS = 100_000


@functools.lru_cache(maxsize=64)
def _ignored(patterns: tuple[str, ...]) -> _Ignored:
    return _Ignored(patterns)


class ContextError(ValueError):
    """A COPY/ADD source that the build context does not hold; the message names it."""


def match_source(source: str, available: list[str]) -> list[str]:
    """The context paths (of `available`, as `context_files` lists them) a COPY/ADD source
    names: itself, `.` for the whole context, or what its glob matches (`*` within one folder,
    as Docker matches)."""
    if escapes_context(source):
        raise ContextError(f"{source} is outside the build context")
    pattern = posixpath.normpath(source.lstrip("/")) if source.strip("/") else "."
    if pattern == ".":
        return ["."]
    if not is_glob(pattern):
        if pattern not in available:
            raise ContextError(f"{source} is not in the build context (or is .dockerignored)")
        return [pattern]
    parts = pattern.split("/")
    found = [
        rel
        for rel in available
        if rel.count("/") == len(parts) - 1
        and all(fnmatch.fnmatchcase(a, b) for a, b in zip(rel.split("/"), parts, strict=True))
    ]
    if not found:
        raise ContextError(f"{source} matches no file in the build context")
    return found


class FileDigests:
    """Content digests of regular files, each file read once per (device, inode, mtime, size)."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, int, int], bytes] = {}
        self._lock = threading.Lock()

    def digest(self, path: str, info: os.stat_result) -> bytes:
        key = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)
        known = self._known.get(key)
        if known is not None:
            return known
        hasher = hashlib.sha256()
        fd = os.open(path, os.O_RDONLY)  # not open(): its buffered file costs more than a read
        try:
            while chunk := os.read(fd, _CHUNK):
                hasher.update(chunk)
        finally:
            os.close(fd)
        return self._remember(key, hasher.digest())

    def read(self, path: str) -> bytes:
        """A small file's content (a link followed), its digest remembered on the way, so a
        file both read and hashed (the Dockerfile, `.dockerignore`) is read once."""
        data, info = read_small(path)
        self._remember(
            (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size),
            hashlib.sha256(data).digest(),
        )
        return data

    def _remember(self, key: tuple[int, int, int, int], value: bytes) -> bytes:
        with self._lock:
            self._known[key] = value
        return value


def context_hash(
    context: Path,
    digests: FileDigests | None = None,
    build_args: Mapping[str, str] | None = None,
) -> str:
    """Hex SHA-256 naming the image that `docker build context` makes with `build_args` (only
    those its Dockerfile declares: the others do not reach the build). Raises OSError."""
    digests = digests or FileDigests()
    hasher = hashlib.sha256(_HASH_VERSION)
    root = str(context)
    for rel in context_files(context, digests):
        full = os.path.join(root, rel)
        info = os.lstat(full)
        mode = info.st_mode
        if stat.S_ISREG(mode):
            payload = digests.digest(full, info)
        elif stat.S_ISLNK(mode):
            payload = os.readlink(full).encode()
        else:
            payload = b""
        hasher.update(b"%s\0%o\0%s\n" % (rel.encode(), mode, payload))
    dockerfile = os.path.join(root, DOCKERFILE)
    hasher.update(b"dockerfile\0" + digests.digest(dockerfile, os.stat(dockerfile)))
    for name, value in sorted((build_args or {}).items()):
        hasher.update(b"build-arg\0%s\0%s\n" % (name.encode(), value.encode()))
    return hasher.hexdigest()
