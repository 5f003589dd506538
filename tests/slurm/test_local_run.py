"""The local executor: the same run as on Slurm, as processes on this machine, no Slurm needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import cli_json
from tests.support.sample_tasks import make_task

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]


def test_the_local_executor_runs_without_slurm(debian_sif: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    for name in ("one", "two"):
        make_task(tasks, name, image=str(debian_sif), agent_timeout_sec=30)
    run_dir = tmp_path / "run"
    submitted = cli_json(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "local", "--concurrency", "2", "--wait",
    )  # fmt: skip
    assert submitted["executor"] == "local"
    statuses = cli_json("status", str(run_dir))
    assert {(s["state"], s["reward"]) for s in statuses} == {("done", 1.0)}
