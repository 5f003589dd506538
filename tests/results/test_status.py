"""Status from markers, result.json files and whether each job still lives (real processes)."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from harbor.trial.errors import AgentTimeoutError

from harbor_hpc.results.record import (
    Chunk,
    Marker,
    RunPaths,
    RunRecord,
    Submission,
    Unit,
    create_run,
    update_run,
    write_marker,
)
from harbor_hpc.results.status import _expand_array, attempt_statuses, summarize
from tests.results.test_classify import harbor_result


@pytest.fixture
def live_pid() -> Iterator[int]:
    process = subprocess.Popen(["sleep", "60"])
    yield process.pid
    process.kill()
    process.wait()


@pytest.fixture
def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def marker(trial: str, task: str, job: str, submission: int = 1) -> Marker:
    return Marker(trial, task, 0, submission, job, socket.gethostname(), 1, f"2026-01-01T{trial}")


def test_every_state_and_class(tmp_path: Path, live_pid: int, dead_pid: int) -> None:
    run_dir = tmp_path / "run"
    record = RunRecord(
        tasks_root=str(tmp_path),
        tasks=["done", "timeout", "running", "pending", "lost", "dead", "noimage"],
        agent="oracle",
        model=None,
        agent_kwargs={},
        environment="x:Y",
        environment_kwargs={},
        options={"attempts": 1},
        image_problems={"noimage": "task.toml: no environment.docker_image"},
    )
    create_run(run_dir, record)
    live, dead = str(live_pid), str(dead_pid)
    with update_run(run_dir) as fresh:
        fresh.submissions.append(
            Submission(
                1,
                "local",
                socket.gethostname(),
                "t",
                {},
                [
                    Chunk([Unit(t, 0) for t in ("done", "timeout", "running", "pending")], live),
                    Chunk([Unit("lost", 0), Unit("dead", 0)], dead),
                ],
            )
        )
    paths = RunPaths(run_dir)
    results = {
        "t1": harbor_result(tmp_path, rewards={"reward": 1}),
        "t2": harbor_result(tmp_path, exception=AgentTimeoutError("timed out after 2 s")),
    }
    for trial, task, job in (
        ("t1", "done", live),
        ("t2", "timeout", live),
        ("t3", "running", live),
        ("t4", "lost", dead),
    ):
        write_marker(run_dir, marker(trial, task, job))
        paths.trial(trial).mkdir(parents=True)
        if trial in results:
            (paths.trial(trial) / "result.json").write_text(json.dumps(results[trial]))

    statuses = {s.task: s for s in attempt_statuses(run_dir)}
    got = {task: (s.state, s.failure, s.trial) for task, s in statuses.items()}
    assert got == {
        "done": ("done", None, "t1"),
        "timeout": ("failed", "timeout", "t2"),
        "running": ("running", None, "t3"),
        "pending": ("pending", None, None),
        "lost": ("failed", "infrastructure", "t4"),
        "dead": ("failed", "infrastructure", None),
        "noimage": ("failed", "image", None),
    }
    assert statuses["done"].reward == 1.0
    summary = summarize(list(statuses.values()))
    assert summary.states == {"pending": 1, "running": 1, "done": 1, "failed": 4}
    assert summary.failures == {"image": 1, "infrastructure": 2, "timeout": 1}
    assert summary.mean_reward == 1.0
    assert not summary.finished

    # A deleted trial folder is a lost result, whatever the trial came to.
    for child in paths.trial("t1").iterdir():
        child.unlink()
    paths.trial("t1").rmdir()
    done = next(s for s in attempt_statuses(run_dir) if s.task == "done")
    assert (done.state, done.failure) == ("running", None)  # its job is alive: not yet lost


def test_squeue_array_ranges_expand() -> None:
    assert _expand_array("12_[0-2,5%2]") == ["12_0", "12_1", "12_2", "12_5"]
    assert _expand_array("12_3") == ["12_3"]
