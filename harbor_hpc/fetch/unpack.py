"""Unpack untrusted archives (.tar, .tar.gz, .tgz, .zip) so that they can only write where asked.

Dataset archives come from strangers. Before a single byte is written, every member is checked
against a model of the tree the archive would build: the archive is refused whole, naming the
member, when a name is absolute or climbs out with `..`, when a symlink or hard link points out,
when a member would be written through a link that leads out, when a member is a device, fifo or
anything else that is not a file, folder or link, or when a link shares its path with another
member (extracting in order could then write through it). Links that stay inside are kept.

The model is exact because unpacking goes into a new, empty folder: the only links on the way are
the archive's own, and they are followed here the way the kernel follows them. tarfile's own
`data` filter (which strips absolute names instead of refusing them, and had bypasses such as
CVE-2025-4517 fixed only in later 3.12 releases) is still applied while extracting, as a second
guard.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from harbor_hpc.core.errors import HarborHpcError

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")

# The kernel gives up after 40 symlinks in one lookup (ELOOP); so does the model.
_MAX_LINK_FOLLOWS = 40
_LOOP = "goes through a loop of symbolic links"
_COPY_CHUNK = 1 << 20
# A zip stores a symlink's target as the entry's content; anything longer than PATH_MAX is not one.
_MAX_LINK_TARGET = 4096


class Kind(StrEnum):
    """What an archive member makes on disk."""

    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"
    HARDLINK = "hardlink"


def is_archive(name: str) -> bool:
    return name.lower().endswith(ARCHIVE_SUFFIXES)


class UnsafeArchiveError(HarborHpcError):
    """The archive was refused; nothing of it was written. `member` is the entry at fault."""

    def __init__(self, archive: str, member: str, reason: str) -> None:
        super().__init__(
            f"{archive}: refused, member {member!r} {reason}; nothing of it was unpacked",
            hint="the archive is unsafe or damaged: tell the dataset's authors, and fetch the "
            "other archives with --include",
        )
        self.archive = archive
        self.member = member
        self.reason = reason


@dataclass(frozen=True)
class Member:
    """One archive entry: `name` as stored, `target` for links (symlink text, hard link path)."""

    name: str
    kind: Kind
    target: str | None = None


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Tree:
    """The tree an archive's members build in an empty folder, with its symlinks to follow."""

    def __init__(self) -> None:
        self.links: dict[tuple[str, ...], str] = {}
        self._follows = 0

    def resolve(self, start: tuple[str, ...], parts: Sequence[str]) -> tuple[str, ...]:
        """Where `parts`, taken from folder `start`, lands once every link on the way is followed.

        Raises `_Refused` when the walk leaves the root, by `..` or through a link.
        """
        self._follows = 0
        return self._walk(start, parts)

    def _walk(self, start: tuple[str, ...], parts: Sequence[str]) -> tuple[str, ...]:
        here = list(start)
        for part in parts:
            if part in ("", "."):
                continue
            if part == "..":
                if not here:
                    raise _Refused("climbs out of the destination with '..'")
                here.pop()
                continue
            here.append(part)
            target = self.links.get(tuple(here))
            if target is None:
                continue
            self._follows += 1
            if self._follows > _MAX_LINK_FOLLOWS:
                raise _Refused(_LOOP)
            try:
                here = list(self._walk(tuple(here[:-1]), target.split("/")))
            except _Refused as exc:
                if exc.reason == _LOOP:
                    raise
                raise _Refused(
                    f"goes through the link {'/'.join(here)!r} that points out of the destination"
                ) from None
        return tuple(here)


def _split(name: str) -> list[str]:
    return [part for part in name.split("/") if part not in ("", ".")]


def check_members(archive: str, members: Sequence[Member]) -> None:
    """Refuse the archive (raise `UnsafeArchiveError`) unless every member stays inside."""
    for member in members:
        if member.name.startswith("/"):
            raise UnsafeArchiveError(archive, member.name, "has an absolute path")
        parts = _split(member.name)
        if parts and parts[-1] == "..":
            raise UnsafeArchiveError(archive, member.name, "names a folder above itself ('..')")
        if parts and member.name.rstrip("/").endswith("/.") and member.kind != Kind.DIR:
            raise UnsafeArchiveError(archive, member.name, f"names a folder but is a {member.kind}")
    # Members in archive order, as extraction meets them: each is placed by following the links
    # seen so far, which is what extraction into an empty folder does on disk.
    tree = _Tree()
    owner: dict[tuple[str, ...], Member] = {}
    files: set[tuple[str, ...]] = set()
    symlinks: list[tuple[Member, tuple[str, ...]]] = []
    for member in members:
        parts = _split(member.name)
        if not parts:
            continue
        try:
            where = (*tree.resolve((), parts[:-1]), parts[-1])
            if member.kind == Kind.HARDLINK:
                _check_hard_link(tree, files, member)
        except _Refused as exc:
            raise UnsafeArchiveError(archive, member.name, exc.reason) from None
        previous = owner.get(where)
        if previous is not None and Kind.SYMLINK in (previous.kind, member.kind):
            raise UnsafeArchiveError(
                archive, member.name, f"is a second entry for the link {previous.name!r}"
            )
        if previous is not None and previous.kind != member.kind:
            raise UnsafeArchiveError(
                archive, member.name, f"is both a {previous.kind} and a {member.kind}"
            )
        owner[where] = member
        if member.kind == Kind.FILE:
            files.add(where)
        elif member.kind == Kind.SYMLINK:
            assert member.target is not None
            if member.target.startswith("/"):
                raise UnsafeArchiveError(
                    archive, member.name, f"is a link to the absolute path {member.target!r}"
                )
            tree.links[where] = member.target
            symlinks.append((member, where))
    # Anyone may follow a symlink later: it must stay inside the finished tree.
    for member, where in symlinks:
        assert member.target is not None
        try:
            tree.resolve(where[:-1], member.target.split("/"))
        except _Refused as exc:
            reason = exc.reason
            if reason.startswith("climbs"):
                reason = f"is a link to {member.target!r}, outside the destination"
            raise UnsafeArchiveError(archive, member.name, reason) from None


def _check_hard_link(tree: _Tree, files: set[tuple[str, ...]], member: Member) -> None:
    """A tar hard link names an earlier file member (tar looks nothing else up)."""
    assert member.target is not None
    if member.target.startswith("/"):
        raise _Refused(f"is a hard link to the absolute path {member.target!r}")
    if tree.resolve((), member.target.split("/")) not in files:
        raise _Refused(
            f"is a hard link to {member.target!r}, which is not an earlier file of the archive"
        )


def check(archive: Path, *, label: str | None = None) -> None:
    """Refuse `archive` as `unpack` would, writing nothing (for `--dry-run`)."""
    name = label or archive.name
    with _readable(name):
        if _is_zip(archive):
            with zipfile.ZipFile(archive) as zipped:
                check_members(name, [_zip_member(name, zipped, i) for i in zipped.infolist()])
        else:
            with tarfile.open(archive) as tar:
                check_members(name, [_tar_member(name, info) for info in tar.getmembers()])


def unpack(archive: Path, into: Path, *, label: str | None = None) -> list[str]:
    """Check `archive`, then unpack it into the empty folder `into`; return the top-level names.

    `label` names the archive in messages (its repository path). A refused archive writes
    nothing; when extraction itself fails (a damaged archive, a full disk) the caller removes
    `into`.
    """
    name = label or archive.name
    with _readable(name):
        if _is_zip(archive):
            _unpack_zip(archive, into, name)
        else:
            _unpack_tar(archive, into, name)
    return sorted(os.listdir(into))


def _is_zip(archive: Path) -> bool:
    return archive.name.lower().endswith(".zip")


@contextlib.contextmanager
def _readable(label: str) -> Iterator[None]:
    # zipfile raises RuntimeError for an encrypted member and NotImplementedError for an
    # unknown compression method; gzip raises EOFError or zlib.error for a truncated stream.
    try:
        yield
    except (
        tarfile.TarError,
        zipfile.BadZipFile,
        EOFError,
        zlib.error,
        RuntimeError,
        NotImplementedError,
    ) as exc:
        raise HarborHpcError(
            f"{label}: not a readable archive ({exc}); nothing of it was unpacked",
            hint="the download may be damaged: delete it from the Hugging Face cache "
            "(HF_HOME) and fetch again",
        ) from None


def _write_failed(label: str, member: str, exc: Exception) -> HarborHpcError:
    return HarborHpcError(
        f"{label}: member {member!r} could not be written ({exc}); nothing of it was unpacked",
        hint="check the free space and permissions of the destination; if they are fine, the "
        "archive is malformed (e.g. a file where it also has a folder)",
    )


def _unpack_tar(archive: Path, into: Path, label: str) -> None:
    with tarfile.open(archive) as tar:
        tar.errorlevel = 2  # every extraction problem raises; none is only logged
        infos = tar.getmembers()
        check_members(label, [_tar_member(label, info) for info in infos])
        for info in infos:
            if not _split(info.name):
                continue  # the archive's own "./": `into` is already there
            try:
                tar.extract(info, into, filter="data")
            except tarfile.FilterError as exc:
                raise UnsafeArchiveError(
                    label, info.name, f"was refused by tarfile: {exc}"
                ) from None
            except (OSError, tarfile.ExtractError) as exc:
                raise _write_failed(label, info.name, exc) from None


def _tar_member(archive: str, info: tarfile.TarInfo) -> Member:
    if info.isreg():
        return Member(info.name, Kind.FILE)
    if info.isdir():
        return Member(info.name, Kind.DIR)
    if info.issym():
        return Member(info.name, Kind.SYMLINK, info.linkname)
    if info.islnk():
        return Member(info.name, Kind.HARDLINK, info.linkname)
    if info.ischr() or info.isblk():
        raise UnsafeArchiveError(archive, info.name, "is a device")
    if info.isfifo():
        raise UnsafeArchiveError(archive, info.name, "is a fifo")
    raise UnsafeArchiveError(archive, info.name, f"has the unsupported tar type {info.type!r}")


def _unpack_zip(archive: Path, into: Path, label: str) -> None:
    with zipfile.ZipFile(archive) as zipped:
        infos = zipped.infolist()
        members = [_zip_member(label, zipped, info) for info in infos]
        check_members(label, members)
        for info, member in zip(infos, members, strict=True):
            try:
                _write_zip_member(zipped, info, member, into)
            except OSError as exc:
                raise _write_failed(label, info.filename, exc) from None


def _zip_mode(info: zipfile.ZipInfo) -> int:
    """The Unix mode stored by Unix zip tools (0 when the archive was made elsewhere)."""
    return info.external_attr >> 16 if info.create_system == 3 else 0


def _zip_member(archive: str, zipped: zipfile.ZipFile, info: zipfile.ZipInfo) -> Member:
    mode = _zip_mode(info)
    kind = stat.S_IFMT(mode)
    if kind == stat.S_IFLNK:
        if info.file_size > _MAX_LINK_TARGET:
            raise UnsafeArchiveError(archive, info.filename, "is a link with an overlong target")
        target = zipped.read(info).decode("utf-8", errors="surrogateescape")
        return Member(info.filename, Kind.SYMLINK, target)
    if info.is_dir() or kind == stat.S_IFDIR:
        return Member(info.filename, Kind.DIR)
    if kind in (stat.S_IFCHR, stat.S_IFBLK):
        raise UnsafeArchiveError(archive, info.filename, "is a device")
    if kind == stat.S_IFIFO:
        raise UnsafeArchiveError(archive, info.filename, "is a fifo")
    if kind not in (0, stat.S_IFREG):
        raise UnsafeArchiveError(archive, info.filename, f"has the unsupported mode {mode:o}")
    return Member(info.filename, Kind.FILE)


def _write_zip_member(
    zipped: zipfile.ZipFile, info: zipfile.ZipInfo, member: Member, into: Path
) -> None:
    parts = _split(member.name)
    if not parts:
        return
    path = into.joinpath(*parts)
    if member.kind == Kind.DIR:
        path.mkdir(parents=True, exist_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if member.kind == Kind.SYMLINK:
        assert member.target is not None
        os.symlink(member.target, path)
        return
    # Executable bits are what make solve.sh and test.sh runnable; group/other write never.
    mode = 0o755 if _zip_mode(info) & 0o100 else 0o644
    # O_NOFOLLOW: the last component is never a link (checked above); refuse if it were.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as out, zipped.open(info) as source:
        shutil.copyfileobj(source, out, _COPY_CHUNK)
