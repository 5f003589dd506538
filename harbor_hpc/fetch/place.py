"""Put downloaded files and unpacked archives into the destination folder, once.

The destination remembers, in `DEST/.harbor-hpc-fetch.json`, the content hash of every archive it
unpacked and the top-level entries that archive produced, and of every task of a Harbor registry
dataset it placed (under the task's folder name, its one entry). A rerun skips an archive or task
whose hash is unchanged and whose entries are all there, and replaces the entries of one that
changed.

Nothing half-done ever looks finished: an archive is unpacked (and a registry dataset downloaded)
into a hidden staging folder at the top of DEST (`discover_tasks` skips hidden folders) and its
entries are renamed into place only when all of it was written. The state file is marked
"pending" before the first rename, so a run that dies during the renames is redone from scratch
next time. One run at a time holds `DEST/.harbor-hpc-fetch.lock`; leftovers of a dead run are
removed when the next starts.
"""

from __future__ import annotations

import contextlib
import filecmp
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_copy, atomic_write_json, file_lock, read_json
from harbor_hpc.fetch.unpack import unpack

log = logging.getLogger(__name__)

STATE_FILE = ".harbor-hpc-fetch.json"
LOCK_FILE = ".harbor-hpc-fetch.lock"
_STAGING_PREFIX = ".harbor-hpc-staging-"
_STATE_VERSION = 1
_HASH_CHUNK = 1 << 20
# Long enough for a colleague's fetch to finish a small step, short enough not to look hung.
_LOCK_TIMEOUT_S = 10.0


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def archive_folder(repo_path: str) -> str:
    """The folder an archive unpacks into: the one it sits in (`tar -C DEST/<folder>`)."""
    parent = PurePosixPath(repo_path).parent.as_posix()
    return "" if parent == "." else parent


@dataclass(frozen=True)
class Failure:
    """A file, archive or task that was not put into DEST; `member` is set for a refused archive."""

    path: str
    message: str
    hint: str | None = None
    member: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "member": self.member, "message": self.message}


@dataclass(frozen=True)
class Staging:
    """A hidden folder in DEST (so on its filesystem: renames move from it): new entries are
    written into `new`, the entries they replace are moved to `old`, and all goes with it."""

    new: Path
    old: Path


@dataclass
class ArchiveRecord:
    sha256: str | None
    roots: list[str] = field(default_factory=list)


def load_state(dest: Path) -> dict[str, ArchiveRecord]:
    """What earlier runs unpacked into `dest`, by archive path in the repository."""
    path = dest / STATE_FILE
    if not path.exists():
        return {}
    data = read_json(path)
    archives = data.get("archives") if isinstance(data, dict) else None
    if data.get("version") != _STATE_VERSION or not isinstance(archives, dict):
        raise HarborHpcError(
            f"{path}: not a state file this harbor-hpc understands",
            hint="delete it; the next fetch then unpacks every archive again",
        )
    return {
        name: ArchiveRecord(entry.get("sha256"), list(entry.get("roots", [])))
        for name, entry in archives.items()
    }


class Destination:
    """DEST while one fetch holds it: use `Destination.open(dest)`."""

    def __init__(self, root: Path, state: dict[str, ArchiveRecord]) -> None:
        self.root = root
        self.state = state

    @classmethod
    @contextlib.contextmanager
    def open(cls, root: Path) -> Iterator[Destination]:
        root = root.expanduser().absolute()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HarborHpcError(f"{root}: cannot create the destination ({exc})") from None
        with file_lock(root / LOCK_FILE, timeout=_LOCK_TIMEOUT_S):
            for leftover in root.glob(f"{_STAGING_PREFIX}*"):
                log.info("removing %s, left by an interrupted fetch", leftover)
                shutil.rmtree(leftover, ignore_errors=True)
            yield cls(root, load_state(root))

    def is_unchanged(self, key: str, sha256: str) -> bool:
        record = self.state.get(key)
        if record is None or record.sha256 != sha256:
            return False
        folder = self.root / archive_folder(key)
        return all(os.path.lexists(folder / root) for root in record.roots)

    def has_copy(self, repo_path: str, source: Path) -> bool:
        """DEST/repo_path is already a file with the same bytes as `source`."""
        target = self.root / repo_path
        return target.is_file() and filecmp.cmp(source, target, shallow=False)

    def place_file(self, repo_path: str, source: Path) -> bool:
        """Copy `source` to DEST/repo_path unless an identical file is there; True if copied.

        A copy, not a hard link into the Hugging Face cache: editing a fetched file must never
        change the cached one.
        """
        if self.has_copy(repo_path, source):
            return False
        target = self.root / repo_path
        if target.is_dir():
            raise HarborHpcError(
                f"{target}: is a folder, but the repository has a file there ({repo_path})",
                hint="move the folder away and fetch again",
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_copy(source, target)
        return True

    @contextlib.contextmanager
    def staging(self) -> Iterator[Staging]:
        """A new staging folder in DEST, removed with whatever is left in it."""
        folder = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=self.root))
        try:
            staging = Staging(new=folder / "new", old=folder / "old")
            staging.new.mkdir()
            staging.old.mkdir()
            yield staging
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def unpack_archive(self, repo_path: str, source: Path, sha256: str) -> list[str]:
        """Unpack `source` (the archive at `repo_path`) into its folder; return its new entries.

        Raises `UnsafeArchiveError` (or `HarborHpcError`) with DEST exactly as it was.
        """
        with self.staging() as staging:
            roots = unpack(source, staging.new, label=repo_path)
            self.install(repo_path, staging, roots, sha256)
        return roots

    def install(self, key: str, staging: Staging, roots: list[str], sha256: str) -> None:
        """Rename `roots`, entries of `staging.new`, into the folder of `key` (an archive's
        repository path, or a registry task's folder name), replacing those an earlier run
        recorded under `key`, and record them with `sha256`.

        Raises `HarborHpcError` with DEST exactly as it was when an entry would replace what no
        earlier fetch of `key` made.
        """
        folder = self.root / archive_folder(key)
        previous = self.state.get(key, ArchiveRecord(None))
        self._refuse_foreign(key, folder, roots, previous.roots)
        self._save(key, ArchiveRecord(None, sorted({*previous.roots, *roots})))
        folder.mkdir(parents=True, exist_ok=True)
        for old in previous.roots:
            if os.path.lexists(folder / old):
                os.replace(folder / old, staging.old / old)
        for new in roots:
            os.replace(staging.new / new, folder / new)
        self._save(key, ArchiveRecord(sha256, roots))

    def _refuse_foreign(self, key: str, folder: Path, roots: list[str], owned: list[str]) -> None:
        """Never replace what `key` did not make: the user's, another archive's or task's."""
        for root in roots:
            target = folder / root
            if os.path.lexists(target) and root not in owned:
                raise HarborHpcError(
                    f"{key}: not placed, it would replace {target}, "
                    f"which an earlier fetch of {key} did not create",
                    hint=f"move {target} away (or pick another --dest) and fetch again",
                )

    def _save(self, key: str, record: ArchiveRecord) -> None:
        self.state[key] = record
        archives: dict[str, Any] = {
            name: {"sha256": entry.sha256, "roots": entry.roots}
            for name, entry in sorted(self.state.items())
        }
        atomic_write_json(self.root / STATE_FILE, {"version": _STATE_VERSION, "archives": archives})
