"""examples/quickstart.sh, run as written: the whole flow on the bundled example tasks, with
Docker (tests/e2e/test_readme.py runs the README's own quick start, without Docker).

It runs as whoever runs pytest, and CI runs pytest as its ordinary user (HARBOR_HPC_TEST_USER,
not root), so the cluster half (convert, rewrite, submit, status, export) is checked as a
cluster user runs it: the test asserts it is that user and that everything the flow wrote, the
Slurm jobs' trial folders included, is that user's.

The examples build FROM a public image; where it cannot be pulled (CI has no Docker Hub), the
quick start's one override, HARBOR_HPC_BASE_IMAGE, names the local base image CI provisions.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.docker
@pytest.mark.registry
@pytest.mark.apptainer
@pytest.mark.slurm
def test_quickstart_runs_the_examples_to_reward_one_and_a_rerun_does_nothing(
    tmp_path: Path,
) -> None:
    test_user = os.environ.get("HARBOR_HPC_TEST_USER")
    if test_user:
        assert pwd.getpwuid(os.getuid()).pw_name == test_user
    work = tmp_path / "quickstart"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    base = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE")
    if base:
        env["HARBOR_HPC_BASE_IMAGE"] = base
    command = ["bash", str(REPO / "examples" / "quickstart.sh"), str(work)]

    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    rollouts = [json.loads(line) for line in (work / "rollouts.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in rollouts) == ["fix-python", "hello-world", "word-count"]
    assert all(r["reward"] == 1.0 for r in rollouts)
    manifest = json.loads((work / "manifest.json").read_text())
    assert len(manifest["images"]) == 2  # hello-world and fix-python share one build context
    written = [work, *work.rglob("*")]
    assert {path.lstat().st_uid for path in written} == {os.getuid()}

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to submit" in again.stdout + again.stderr
    assert len(list((work / "run" / "trials").iterdir())) == 3
