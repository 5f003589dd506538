"""The local executor: the same run as on Slurm, as processes on this machine, no Slurm needed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.api import Progress, RolloutRequest, resubmit_run, run_status, stream_rollouts
from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.results.record import CANCELLED, RunPaths, read_marker
from tests.support.cli import cli_json
from tests.support.processes import gone_within, left_naming
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
    # The workers noted what their trials came to: status read that, not the trials' folders.
    trials = RunTrials(run_dir, reward_key=None)
    assert len(trials.markers) == 2
    assert all(trials.noted(marker.trial) is not None for marker in trials.markers)


def test_a_batch_streams_as_it_ends_and_its_deadline_cancels_the_rest(
    debian_sif: Path, tmp_path: Path
) -> None:
    """A trainer's batch from Python: each line as its attempt ends, progress as counts change,
    and at the deadline the straggler is cancelled (named, not trainable, its container gone),
    for `resubmit` to run again."""
    tasks = tmp_path / "tasks"
    for name in ("one", "two"):
        make_task(tasks, name, image=str(debian_sif))
    make_task(tasks, "straggler", kind="slow", image=str(debian_sif), agent_timeout_sec=900)
    run_dir = tmp_path / "run"
    request = RolloutRequest(
        tasks=tasks, run_dir=run_dir, agent="oracle", concurrency=3, deadline_s=40
    )
    seen: list[Progress] = []

    async def collect() -> list[tuple[dict[str, Any], float]]:
        got = []
        async with contextlib.aclosing(stream_rollouts(request, progress=seen.append)) as lines:
            async for line in lines:
                got.append((line, time.monotonic()))
        return got

    # What the straggler's marker said the moment its result.json appeared: a reader then (the
    # stream) must already see that the cancel broke it.
    marked: list[str | None] = []
    stop = threading.Event()

    def watch() -> None:
        paths = RunPaths(run_dir)
        while not stop.is_set() and not marked:
            for result in paths.trials.glob("straggler__*/result.json"):
                marker = read_marker(paths.marker(result.parent.name))
                marked.append(marker.terminated_by if marker else "no marker")
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    began = time.monotonic()
    try:
        got = asyncio.run(collect())
    finally:
        stop.set()
        watcher.join()
    assert marked == [CANCELLED]
    lines = {line["task"]: line for line, _ in got}
    assert [(lines[t]["reward"], lines[t]["trainable"]) for t in ("one", "two")] == [
        (1.0, True),
        (1.0, True),
    ]
    solved_at = max(at for line, at in got if line["task"] != "straggler") - began
    assert solved_at < 40, "the solved ones stream before the deadline"
    straggler = lines["straggler"]
    assert (straggler["failure"], straggler["trainable"]) == ("infrastructure", False)
    assert "a cancel of the run" in straggler["message"]
    assert seen[0].total == 3 and seen[-1] == Progress(
        done=2, failed=1, running=0, pending=0, total=3
    )
    assert any(p.running for p in seen)
    # Nothing is left (on a busy machine the containers take their time to stop).
    assert gone_within(60, lambda: left_naming(str(run_dir))) == []
    # The run is a run like any other: the cancelled attempt is the one to run again.
    again = resubmit_run(run_dir, dry_run=True)
    assert [unit.task for unit in again.units] == ["straggler"]


def test_leaving_a_stream_early_cancels_the_rest_and_returns_once_it_ended(
    debian_sif: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    make_task(tasks, "quick", image=str(debian_sif))
    for name in ("slow-1", "slow-2"):
        make_task(tasks, name, kind="slow", image=str(debian_sif), agent_timeout_sec=900)
    run_dir = tmp_path / "run"
    request = RolloutRequest(tasks=tasks, run_dir=run_dir, agent="oracle", concurrency=3)

    async def first() -> dict[str, Any]:
        async with contextlib.aclosing(stream_rollouts(request)) as lines:
            async for line in lines:
                return line
        raise AssertionError("no line")

    assert asyncio.run(first())["task"] == "quick"
    # Back in the caller, the run's status is final: nothing left running.
    statuses = {s.task: s for s in run_status(run_dir).attempts}
    assert statuses["quick"].state == "done"
    for name in ("slow-1", "slow-2"):
        assert (statuses[name].state, statuses[name].failure) == ("failed", "infrastructure")
        assert "a cancel of the run" in (statuses[name].message or "")
    assert gone_within(60, lambda: left_naming(str(run_dir))) == []
