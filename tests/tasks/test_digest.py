"""Task digests: what tells a run that a task changed (tasks/digest.py), on the example tasks."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.tasks.digest import changed_parts, task_digest, task_digests

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks"


@pytest.fixture
def task(tmp_path: Path) -> Path:
    return Path(shutil.copytree(EXAMPLES / "word-count", tmp_path / "word-count"))


def test_each_part_is_hashed_and_a_change_is_named(task: Path) -> None:
    before = task_digest(task)
    assert set(before) == {"instruction.md", "task.toml", "tests", "environment", "solution"}
    (task / "tests" / "test.sh").write_text("echo 0.25 > /logs/verifier/reward.txt\n")
    (task / "instruction.md").write_text("Count the lines instead.\n")
    after = task_digest(task)
    assert changed_parts(before, after, "terminus-2") == ["instruction.md", "tests"]


def test_the_same_files_again_are_the_same_task(task: Path, tmp_path: Path) -> None:
    before = task_digest(task)
    os.utime(task / "tests" / "test.sh", (0, 0))  # another unpacking: other mtimes
    (task / "tests" / "__pycache__").mkdir()
    (task / "tests" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert task_digest(task) == before
    # Another copy elsewhere (another tasks root) is the same task too.
    assert task_digest(Path(shutil.copytree(task, tmp_path / "again"))) == before
    # A file made executable is a change (a test script that could not run before).
    (task / "environment" / "files" / "words.txt").chmod(0o755)
    assert changed_parts(before, task_digest(task), "oracle") == ["environment"]


def test_the_solution_counts_only_for_the_agent_that_runs_it(task: Path) -> None:
    before = task_digest(task)
    (task / "solution" / "solve.sh").write_text("#!/bin/sh\ntrue\n")
    after = task_digest(task)
    assert changed_parts(before, after, "terminus-2") == []
    assert changed_parts(before, after, "oracle") == ["solution"]


def test_a_run_folder_inside_the_task_is_left_out(task: Path) -> None:
    before = task_digest(task)
    run_dir = task / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    assert task_digest(task, skip=run_dir) == before
    assert task_digest(task) != before  # without it, the run's own files would be the task's


def test_a_gone_task_and_an_unreadable_file(task: Path, tmp_path: Path) -> None:
    found = task_digests({"word-count": task, "gone": tmp_path / "gone"})
    assert found["gone"] is None and found["word-count"] == task_digest(task)
    secret = task / "tests" / "secret.txt"
    secret.write_text("x")
    secret.chmod(0)
    if os.access(secret, os.R_OK):
        pytest.skip("root reads every file")
    with pytest.raises(InputError, match=r"secret\.txt: cannot read it"):
        task_digest(task)
