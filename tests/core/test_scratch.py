"""Private scratch folders: a folder whose owner is gone is removed by the next sweep there,
and no other (an owner alive, a folder being made, another node's or another user's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_hpc.core.scratch import LOCK, PrivateDir, sweep
from tests.support.processes import gone_within

OWNER = """
import os, signal, sys
from pathlib import Path
from harbor_hpc.core.scratch import PrivateDir
folder = PrivateDir("t-", Path(sys.argv[1]))
(folder.path / "inside").mkdir()
(folder.path / "inside" / "file").write_text("x")
print(folder.path, flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()  # lives until told
"""


def owner(root: Path, fate: str) -> tuple[Path, subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(root), fate],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    return Path(process.stdout.readline().strip()), process


def test_a_sweep_removes_only_the_folders_whose_owner_is_gone(tmp_path: Path) -> None:
    # The living first: making a folder sweeps too (the first of each process).
    alive, living = owner(tmp_path, "live")
    dead, killed = owner(tmp_path, "die")
    assert killed.wait(30) == -signal.SIGKILL
    being_made = tmp_path / "t-being-made"  # no lock file yet: mkdtemp, then the lock
    being_made.mkdir()
    elsewhere = tmp_path / "t-elsewhere"  # another node's, on a filesystem both share
    elsewhere.mkdir()
    (elsewhere / LOCK).write_text("another-node")
    try:
        assert sweep("t-", tmp_path) == [dead]
        assert not dead.exists()
        assert (alive / "inside" / "file").exists()
        assert being_made.exists() and elsewhere.exists()
    finally:
        living.communicate("")
    assert sweep("t-", tmp_path) == [alive]  # its owner ended without removing it


@pytest.mark.skipif(os.geteuid() == 0, reason="root enters every folder")
def test_a_folder_it_cannot_enter_is_left_alone(tmp_path: Path) -> None:
    dead, killed = owner(tmp_path, "die")
    killed.wait(30)
    dead.chmod(0)  # as another user's 0700 folder is to this user
    try:
        assert sweep("t-", tmp_path) == []
    finally:
        dead.chmod(0o700)
    assert sweep("t-", tmp_path) == [dead]


def test_the_owner_removes_its_folder_and_the_first_of_a_process_sweeps(tmp_path: Path) -> None:
    dead, killed = owner(tmp_path, "die")
    killed.wait(30)
    mine = PrivateDir("t-", tmp_path, name="mine-")
    assert mine.path.name.startswith("t-mine-") and mine.path.stat().st_mode & 0o777 == 0o700
    # The sweep runs in the background.
    assert gone_within(10, lambda: [str(dead)] if dead.exists() else []) == []
    assert mine.remove() and not mine.path.exists()
