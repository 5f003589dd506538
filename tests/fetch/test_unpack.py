"""Hostile archives of every kind are refused whole, naming the member; honest ones unpack."""

from __future__ import annotations

import io
import os
import random
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.fetch.unpack import UnsafeArchiveError, check, is_archive, unpack


@dataclass(frozen=True)
class Entry:
    """One archive member to write: a file (content), dir, symlink/hardlink (target), or special."""

    name: str
    kind: str = "file"
    content: bytes = b"data\n"
    target: str = ""
    mode: int = 0o644


def write_tar(path: Path, entries: list[Entry]) -> Path:
    types = {
        "file": tarfile.REGTYPE,
        "dir": tarfile.DIRTYPE,
        "symlink": tarfile.SYMTYPE,
        "hardlink": tarfile.LNKTYPE,
        "chardev": tarfile.CHRTYPE,
        "blockdev": tarfile.BLKTYPE,
        "fifo": tarfile.FIFOTYPE,
    }
    with tarfile.open(path, "w:gz") as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.type = types[entry.kind]
            info.mode = entry.mode
            info.linkname = entry.target
            data = entry.content if entry.kind == "file" else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_zip(path: Path, entries: list[Entry]) -> Path:
    kinds = {
        "file": stat.S_IFREG,
        "dir": stat.S_IFDIR,
        "symlink": stat.S_IFLNK,
        "chardev": stat.S_IFCHR,
        "fifo": stat.S_IFIFO,
    }
    with zipfile.ZipFile(path, "w") as zipped:
        for entry in entries:
            name = entry.name + ("/" if entry.kind == "dir" else "")
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = (kinds[entry.kind] | entry.mode) << 16
            data = entry.target.encode() if entry.kind == "symlink" else entry.content
            zipped.writestr(info, b"" if entry.kind == "dir" else data)
    return path


HONEST = [Entry("pkg/task.toml"), Entry("pkg/solve.sh", mode=0o755)]

# Each hostile archive: its members, the member the refusal must name, a word of the reason.
HOSTILE_TAR: dict[str, tuple[list[Entry], str, str]] = {
    "absolute path": ([*HONEST, Entry("/tmp/evil")], "/tmp/evil", "absolute path"),
    "dotdot": ([*HONEST, Entry("../evil")], "../evil", "climbs out"),
    "dotdot deep": ([*HONEST, Entry("pkg/../../evil")], "pkg/../../evil", "climbs out"),
    "absolute symlink": (
        [*HONEST, Entry("pkg/etc", "symlink", target="/etc")],
        "pkg/etc",
        "absolute path",
    ),
    "symlink out": (
        [*HONEST, Entry("pkg/up", "symlink", target="../../outside")],
        "pkg/up",
        "outside the destination",
    ),
    "write through link": (
        [Entry("up", "symlink", target=".."), Entry("up/evil")],
        "up/evil",
        "link 'up'",
    ),
    "link chain": (
        [Entry("a", "symlink", target="."), Entry("p", "symlink", target="a/a/../..")],
        "p",
        "outside the destination",
    ),
    "link loop": (
        [
            Entry("a", "symlink", target="b"),
            Entry("b", "symlink", target="a"),
            Entry("a/evil"),
        ],
        "a/evil",
        "loop",
    ),
    "file over link": (
        [Entry("pkg", "dir"), Entry("x", "symlink", target="pkg"), Entry("x", "file")],
        "x",
        "second entry for the link",
    ),
    "absolute hardlink": (
        [*HONEST, Entry("pkg/passwd", "hardlink", target="/etc/passwd")],
        "pkg/passwd",
        "absolute path",
    ),
    "hardlink out": (
        [*HONEST, Entry("pkg/passwd", "hardlink", target="../etc/passwd")],
        "pkg/passwd",
        "climbs out",
    ),
    "hardlink to nothing": (
        [*HONEST, Entry("pkg/copy", "hardlink", target="pkg/missing")],
        "pkg/copy",
        "not an earlier file",
    ),
    "hardlink before its file": (
        [Entry("pkg/copy", "hardlink", target="pkg/a.txt"), Entry("pkg/a.txt")],
        "pkg/copy",
        "not an earlier file",
    ),
    "char device": ([*HONEST, Entry("pkg/tty", "chardev")], "pkg/tty", "device"),
    "block device": ([*HONEST, Entry("pkg/sda", "blockdev")], "pkg/sda", "device"),
    "fifo": ([*HONEST, Entry("pkg/pipe", "fifo")], "pkg/pipe", "fifo"),
}

# Zip has no hard links nor block devices; its links are entries with a symlink mode.
ZIP_KINDS = [
    "absolute path",
    "dotdot",
    "absolute symlink",
    "symlink out",
    "write through link",
    "link chain",
    "char device",
    "fifo",
]
HOSTILE = [("tar", case) for case in HOSTILE_TAR] + [("zip", case) for case in ZIP_KINDS]


@pytest.fixture
def sandbox(tmp_path: Path) -> tuple[Path, Path]:
    """An empty folder to unpack into, inside a folder whose other content must not change."""
    outer = tmp_path / "outer"
    into = outer / "into"
    into.mkdir(parents=True)
    return outer, into


def _everything(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.parametrize(("fmt", "case"), HOSTILE, ids=[f"{f}-{c}" for f, c in HOSTILE])
def test_hostile_archive_is_refused_whole(fmt: str, case: str, sandbox: tuple[Path, Path]) -> None:
    outer, into = sandbox
    entries, member, reason = HOSTILE_TAR[case]
    writer, suffix = (write_tar, "tar.gz") if fmt == "tar" else (write_zip, "zip")
    archive = writer(outer.parent / f"hostile.{suffix}", entries)

    with pytest.raises(UnsafeArchiveError) as refused:
        unpack(archive, into, label=f"set/hostile.{suffix}")

    assert refused.value.member == member
    assert reason in refused.value.reason
    assert f"set/hostile.{suffix}" in refused.value.message
    assert _everything(outer) == ["into"]
    with pytest.raises(UnsafeArchiveError):
        check(archive)


def _links_inside() -> list[Entry]:
    """Links that stay inside, including one a member is written through."""
    return [
        Entry("pkg", "dir"),
        Entry("pkg/solve.sh", mode=0o755),
        Entry("pkg/data", "dir"),
        Entry("pkg/latest", "symlink", target="data"),
        Entry("pkg/latest/result.txt", content=b"42\n"),
        Entry("alias", "symlink", target="pkg/solve.sh"),
    ]


@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_links_that_stay_inside_are_kept(fmt: str, sandbox: tuple[Path, Path]) -> None:
    outer, into = sandbox
    writer = write_tar if fmt == "tar" else write_zip
    archive = writer(outer.parent / f"ok.{'tar.gz' if fmt == 'tar' else 'zip'}", _links_inside())
    check(archive)

    roots = unpack(archive, into)

    assert roots == ["alias", "pkg"]
    assert (into / "pkg/data/result.txt").read_text() == "42\n"
    assert os.readlink(into / "pkg/latest") == "data"
    assert os.readlink(into / "alias") == "pkg/solve.sh"
    assert os.stat(into / "pkg/solve.sh").st_mode & 0o111, "executable bit kept"


def test_tar_hardlink_inside_is_kept(sandbox: tuple[Path, Path]) -> None:
    _outer, into = sandbox
    archive = write_tar(
        sandbox[0].parent / "links.tar",
        [Entry("pkg/a.txt", content=b"same\n"), Entry("pkg/b.txt", "hardlink", target="pkg/a.txt")],
    )

    unpack(archive, into)

    assert (into / "pkg/b.txt").read_text() == "same\n"
    assert (into / "pkg/a.txt").stat().st_ino == (into / "pkg/b.txt").stat().st_ino


def test_tar_modes_are_tamed(sandbox: tuple[Path, Path]) -> None:
    """setuid and world-writable bits from strangers do not survive; execute bits do."""
    _outer, into = sandbox
    archive = write_tar(
        sandbox[0].parent / "modes.tar.gz",
        [Entry("pkg/run", mode=0o4777), Entry("pkg/notes", mode=0o666)],
    )

    unpack(archive, into)

    assert stat.S_IMODE((into / "pkg/run").stat().st_mode) == 0o755
    assert stat.S_IMODE((into / "pkg/notes").stat().st_mode) == 0o644


def test_damaged_archive_is_a_clear_error(sandbox: tuple[Path, Path]) -> None:
    outer, into = sandbox
    good = write_tar(outer.parent / "good.tar.gz", HONEST).read_bytes()
    damaged = outer.parent / "damaged.tar.gz"
    damaged.write_bytes(good[: len(good) // 2])

    with pytest.raises(HarborHpcError, match=r"damaged\.tar\.gz: not a readable archive"):
        unpack(damaged, into)


def test_archive_names() -> None:
    assert all(is_archive(n) for n in ("a.tar", "b/c.tar.gz", "d.TGZ", "e.zip"))
    assert not any(is_archive(n) for n in ("a.tar.xz.txt", "README.md", "x.gz", "tar"))


ROUNDS = int(os.environ.get("HARBOR_HPC_FUZZ_ROUNDS", "300"))


@pytest.mark.filterwarnings("ignore:Duplicate name")  # zipfile's, for repeated random names
@pytest.mark.parametrize("fmt", ["tar", "zip"])
def test_random_archives_accepted_only_when_they_stay_inside(fmt: str, tmp_path: Path) -> None:
    """Whatever the checker accepts, real extraction keeps inside; seeded, so reproducible."""
    rng = random.Random(706)
    kinds = ["file", "dir", "symlink", "symlink"] + (["hardlink"] if fmt == "tar" else [])
    names = ["a", "b", "a", "b", "..", "."]
    accepted = 0
    for round_ in range(ROUNDS):
        entries = []
        for _ in range(rng.randint(1, 5)):
            name = "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
            kind = rng.choice(kinds)
            target = "/".join(rng.choice(names) for _ in range(rng.randint(1, 3)))
            entries.append(Entry(name, kind, target=target))
        outer = tmp_path / str(round_)
        into = outer / "box" / "into"
        into.mkdir(parents=True)
        archive = (write_tar if fmt == "tar" else write_zip)(outer / f"x.{fmt}", entries)
        try:
            unpack(archive, into)
            accepted += 1
        except UnsafeArchiveError:
            assert not any(into.iterdir()), entries
        except HarborHpcError:
            pass  # extraction failed (a file where a folder is needed): parts only in `into`
        assert sorted(p.name for p in outer.iterdir()) == ["box", f"x.{fmt}"], entries
        assert [p.name for p in (outer / "box").iterdir()] == ["into"], entries
        for path in into.rglob("*"):
            assert path.resolve().is_relative_to(into.resolve()), (entries, path)
    assert accepted > ROUNDS // 15, "the random archives must exercise extraction too"
