import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import (
    LockTimeout,
    Replacements,
    atomic_write_json,
    atomic_write_text,
    file_lock,
    held_by_another,
    read_json,
)


def test_atomic_write_replaces_and_keeps_mode(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.txt"
    atomic_write_text(target, "one")
    os.chmod(target, 0o640)
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in target.parent.iterdir()] == ["file.txt"]


def test_failed_write_leaves_old_content_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "data.json"
    atomic_write_json(target, {"a": 1})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"a": object()})
    assert read_json(target) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["data.json"]


@pytest.mark.parametrize("count", [3, Replacements.SYNC_EACH_BELOW])  # a fsync each; one syncfs
def test_replacements_write_every_group_or_none_of_it(tmp_path: Path, count: int) -> None:
    paths = [tmp_path / f"t{index}" / "task.toml" for index in range(count)]
    for path in paths:
        path.parent.mkdir()
        path.write_text("old")
    blocked = tmp_path / "t0" / "not-a-folder"
    blocked.write_text("a file")
    with Replacements[int]() as batch:
        with pytest.raises(NotADirectoryError):  # its first file is staged, its second cannot be
            batch.stage(0, [(paths[0], b"new", 0o600), (blocked / "compose.yaml", b"x", 0o644)])
        for index, path in enumerate(paths[1:], start=1):
            batch.stage(index, [(path, b"new %d" % index, 0o640)])
        assert paths[1].read_text() == "old"  # nothing is renamed before the commit
        assert batch.commit() == {}
    assert paths[0].read_text() == "old"
    for index, path in enumerate(paths[1:], start=1):
        assert path.read_text() == f"new {index}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_replacements_name_a_rename_that_fails_and_leave_no_temporary_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "folder" / "inside").mkdir(parents=True)  # a file cannot replace a full folder
    with Replacements[str]() as batch:
        batch.stage("folder", [(tmp_path / "folder", b"new", 0o644)])
        batch.stage("file", [(tmp_path / "file", b"new", 0o644)])
        failed = batch.commit()
    assert list(failed) == ["folder"] and failed["folder"].filename == str(tmp_path / "folder")
    assert (tmp_path / "file").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]


def test_replacements_left_without_a_commit_leave_nothing_behind(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), Replacements[str]() as batch:
        batch.stage("a", [(tmp_path / "a", b"new", 0o644)])
        raise KeyboardInterrupt  # Ctrl-C between staging and the commit
    assert list(tmp_path.iterdir()) == []


def test_read_json_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(HarborHpcError, match=r"bad\.json: not valid JSON"):
        read_json(bad)
    with pytest.raises(HarborHpcError, match=r"missing\.json: no such file"):
        read_json(tmp_path / "missing.json")
    # A folder given as --manifest used to end in "internal error: IsADirectoryError".
    with pytest.raises(HarborHpcError, match=r"cannot read it \(Is a directory\)") as folder:
        read_json(tmp_path)
    assert folder.value.exit_code == 2


def _hold_lock(path: str, ready: "multiprocessing.synchronize.Event") -> None:
    with file_lock(Path(path)):
        ready.set()
        os.kill(os.getpid(), 9)  # die holding the lock, as a crashed job would


def test_lock_times_out_naming_holder_and_dies_with_holder(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    # flock is per open file description: a second open in this process contends too
    with (
        file_lock(lock),
        pytest.raises(LockTimeout, match=r"locked by .*:\d+"),
        file_lock(lock, timeout=0.3),
    ):
        pass
    spawn = multiprocessing.get_context("spawn")  # fork is unsafe once threads run
    ready = spawn.Event()
    proc = spawn.Process(target=_hold_lock, args=(str(lock), ready))
    proc.start()
    proc.join(10)
    assert ready.is_set() and proc.exitcode == -9
    with file_lock(lock, timeout=2):  # the dead holder's lock is gone
        pass


def test_a_lock_file_this_user_may_only_read_still_locks(tmp_path: Path) -> None:
    """Another user's lock file in a shared folder, made before locks were group-writable."""
    lock = tmp_path / ".image.lock"
    lock.write_text("")
    lock.chmod(0o444)
    with file_lock(lock, timeout=0), pytest.raises(LockTimeout), file_lock(lock, timeout=0):
        pass
    assert stat.S_IMODE(lock.stat().st_mode) == 0o444


def test_a_lock_this_user_makes_gets_the_mode_asked(tmp_path: Path) -> None:
    lock = tmp_path / ".image.lock"
    with file_lock(lock, mode=0o664):
        pass
    assert stat.S_IMODE(lock.stat().st_mode) == 0o664


def test_a_lock_held_by_another_process_is_seen_without_taking_it(tmp_path: Path) -> None:
    """`status` asks whether a submit is queueing the run's jobs right now (its lock held),
    never taking the lock nor making its file, and not counting its own process."""
    lock = tmp_path / ".submit.lock"
    assert not held_by_another(lock) and not lock.exists()
    with file_lock(lock):
        assert not held_by_another(lock)  # this process's own
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from harbor_hpc.core.files import file_lock\n"
         "with file_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
         str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert held_by_another(lock)
    finally:
        holder.kill()
        holder.wait()
    assert not held_by_another(lock)
