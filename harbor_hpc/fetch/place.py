"""Put downloaded files and unpacked archives into the destination folder, once.

The destination remembers, in `DEST/.harbor-hpc-fetch.json`, the content hash of every archive it
unpacked and the top-level entries that archive produced. A rerun skips an archive whose hash is
unchanged and whose entries are all there, and replaces the entries of one that changed.

Nothing half-done ever looks finished: an archive is unpacked into a hidden staging folder at the
top of DEST (`discover_tasks` skips hidden folders) and its entries are renamed into place only
when every member checked out and was written. The state file is marked "pending" before the
first rename, so a run that dies during the renames is redone from scratch next time. One run at a
time holds `DEST/.harbor-hpc-fetch.lock`; leftovers of a dead run are removed when the next starts.
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

    def is_unchanged(self, repo_path: str, sha256: str) -> bool:
        record = self.state.get(repo_path)
        if record is None or record.sha256 != sha256:
            return False
        folder = self.root / archive_folder(repo_path)
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

    def unpack_archive(self, repo_path: str, source: Path, sha256: str) -> list[str]:
        """Unpack `source` (the archive at `repo_path`) into its folder; return its new entries.

        Raises `UnsafeArchiveError` (or `HarborHpcError`) with DEST exactly as it was.
        """
        folder = self.root / archive_folder(repo_path)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=self.root))
        unpacked, replaced = staging / "new", staging / "old"
        try:
            unpacked.mkdir()
            replaced.mkdir()
            roots = unpack(source, unpacked, label=repo_path)
            previous = self.state.get(repo_path, ArchiveRecord(None))
            self._refuse_foreign(repo_path, folder, roots, previous.roots)
            self._save(repo_path, ArchiveRecord(None, sorted({*previous.roots, *roots})))
            folder.mkdir(parents=True, exist_ok=True)
            for old in previous.roots:
                if os.path.lexists(folder / old):
                    os.replace(folder / old, replaced / old)
            for new in roots:
                os.replace(unpacked / new, folder / new)
            self._save(repo_path, ArchiveRecord(sha256, roots))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return roots

    def _refuse_foreign(
        self, repo_path: str, folder: Path, roots: list[str], owned: list[str]
    ) -> None:
        """Never replace what this archive did not unpack: the user's or another archive's."""
        for root in roots:
            target = folder / root
            if os.path.lexists(target) and root not in owned:
                raise HarborHpcError(
                    f"{repo_path}: not unpacked, it would replace {target}, "
                    "which an earlier fetch of this archive did not create",
                    hint=f"move {target} away (or pick another --dest) and fetch again",
                )

    def _save(self, repo_path: str, record: ArchiveRecord) -> None:
        self.state[repo_path] = record
        archives: dict[str, Any] = {
            name: {"sha256": entry.sha256, "roots": entry.roots}
            for name, entry in sorted(self.state.items())
        }
        atomic_write_json(self.root / STATE_FILE, {"version": _STATE_VERSION, "archives": archives})
