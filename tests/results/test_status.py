"""Status from markers, result.json files and the set of live jobs the caller hands in."""

from __future__ import annotations

import json
from pathlib import Path

from harbor.trial.errors import AgentTimeoutError

from harbor_hpc.results.record import (
    Chunk,
    Marker,
    RunPaths,
    RunRecord,
    Submission,
    Unit,
    create_run,
    load_run,
    update_run,
    write_marker,
)
from harbor_hpc.results.status import RunStatus, attempt_statuses
from tests.results.test_classify import harbor_result

LIVE, DEAD = "41_0", "41_1"


def marker(trial: str, task: str, job: str | None, submission: int = 1) -> Marker:
    return Marker(trial, task, 0, submission, job, "node-1", 1, f"2026-01-01T{trial}")


def record_with(tmp_path: Path, tasks: list[str], **problems: str) -> Path:
    run_dir = tmp_path / "run"
    record = RunRecord(
        tasks_root=str(tmp_path),
        tasks=tasks,
        agent="oracle",
        model=None,
        agent_kwargs={},
        environment="x:Y",
        environment_kwargs={},
        options={"attempts": 1},
        image_problems=problems,
    )
    create_run(run_dir, record)
    return run_dir


def submit(run_dir: Path, *chunks: Chunk) -> None:
    with update_run(run_dir) as fresh:
        number = len(fresh.submissions) + 1
        fresh.submissions.append(Submission(number, "slurm", "login-1", "t", list(chunks)))


def states(run_dir: Path, alive: set[str]) -> dict[str, tuple[str, str | None, str | None]]:
    found = attempt_statuses(run_dir, load_run(run_dir), alive)
    return {s.task: (s.state, s.failure, s.trial) for s in found}


def test_every_state_and_class(tmp_path: Path) -> None:
    tasks = ["done", "timeout", "running", "pending", "lost", "dead", "noimage"]
    run_dir = record_with(tmp_path, tasks, noimage="task.toml: no environment.docker_image")
    submit(
        run_dir,
        Chunk([Unit(t, 0) for t in ("done", "timeout", "running", "pending")], LIVE),
        Chunk([Unit("lost", 0), Unit("dead", 0)], DEAD),
    )
    paths = RunPaths(run_dir)
    results = {
        "t1": harbor_result(tmp_path, rewards={"reward": 1}),
        "t2": harbor_result(tmp_path, exception=AgentTimeoutError("timed out after 2 s")),
    }
    for trial, task, job in (
        ("t1", "done", LIVE),
        ("t2", "timeout", LIVE),
        ("t3", "running", LIVE),
        ("t4", "lost", DEAD),
    ):
        write_marker(run_dir, marker(trial, task, job))
        paths.trial(trial).mkdir(parents=True)
        if trial in results:
            (paths.trial(trial) / "result.json").write_text(json.dumps(results[trial]))

    found = RunStatus.of(attempt_statuses(run_dir, load_run(run_dir), {LIVE}))
    got = {s.task: (s.state, s.failure, s.trial) for s in found.attempts}
    assert got == {
        "done": ("done", None, "t1"),
        "timeout": ("failed", "timeout", "t2"),
        "running": ("running", None, "t3"),
        "pending": ("pending", None, None),
        "lost": ("failed", "infrastructure", "t4"),
        "dead": ("failed", "infrastructure", None),
        "noimage": ("failed", "image", None),
    }
    assert found.attempts[0].reward == 1.0
    assert found.summary.states == {"pending": 1, "running": 1, "done": 1, "failed": 4}
    assert found.summary.failures == {"image": 1, "infrastructure": 2, "timeout": 1}
    assert found.summary.mean_reward == 1.0
    assert not found.summary.finished
    assert json.loads(json.dumps(found.to_json()))[1]["failure"] == "timeout"

    # Once the live job has gone, what it left unfinished is lost; what it finished stays.
    gone = states(run_dir, set())
    assert gone["running"] == ("failed", "infrastructure", "t3")
    assert gone["pending"] == ("failed", "infrastructure", None)
    assert gone["done"] == ("done", None, "t1")

    # A deleted trial folder is a lost result whatever the trial came to, once its job is gone.
    for child in paths.trial("t1").iterdir():
        child.unlink()
    paths.trial("t1").rmdir()
    assert states(run_dir, {LIVE})["done"] == ("running", None, "t1")
    lost = attempt_statuses(run_dir, load_run(run_dir), set())[0]
    assert (lost.state, lost.failure) == ("failed", "infrastructure")
    assert lost.message == "no result: the trial folder is gone"


def test_a_resubmission_supersedes_the_trials_it_reruns(tmp_path: Path) -> None:
    run_dir = record_with(tmp_path, ["a", "b"])
    submit(run_dir, Chunk([Unit("a", 0), Unit("b", 0)], "41_0"))
    write_marker(run_dir, marker("t1", "a", "41_0"))
    write_marker(run_dir, marker("t2", "b", "41_0"))
    submit(run_dir, Chunk([Unit("a", 0)], "52_0"))  # `resubmit` of the lost one
    assert states(run_dir, {"52_0"}) == {
        "a": ("pending", None, None),  # queued again: the old trial no longer counts
        "b": ("failed", "infrastructure", "t2"),
    }
    write_marker(run_dir, marker("t3", "a", "52_0", submission=2))
    assert states(run_dir, {"52_0"})["a"] == ("running", None, "t3")


def test_a_submission_that_queued_nothing_is_named(tmp_path: Path) -> None:
    run_dir = record_with(tmp_path, ["a", "b"])
    submit(run_dir, Chunk([Unit("a", 0)], None))
    found = attempt_statuses(run_dir, load_run(run_dir), set())
    assert [(s.state, s.message) for s in found] == [
        ("failed", "its submission failed before a job was queued"),
        ("failed", "never submitted"),
    ]


def test_a_trial_the_jobs_end_cut_short_is_lost_whatever_it_recorded(tmp_path: Path) -> None:
    run_dir = record_with(tmp_path, ["a"])
    submit(run_dir, Chunk([Unit("a", 0)], "41_0"))
    cut = Marker("t1", "a", 0, 1, "41_0", "node-1", 1, "2026-01-01T1", terminated_by="SIGTERM")
    write_marker(run_dir, cut)
    RunPaths(run_dir).trial("t1").mkdir(parents=True)
    unsolved = harbor_result(tmp_path, rewards={"reward": 0})  # the agent was killed midway
    (RunPaths(run_dir).trial("t1") / "result.json").write_text(json.dumps(unsolved))
    [status] = attempt_statuses(run_dir, load_run(run_dir), set())
    assert (status.state, status.failure) == ("failed", "infrastructure")
    assert status.message == "job 41_0 got SIGTERM during the trial (reward 0.0)"


def test_a_job_the_cgroups_oom_killer_ended_is_named(tmp_path: Path) -> None:
    """slurmstepd's line (as the real Slurm 22.05 writes it at a job's end, ConstrainRAMSpace)
    in the job's log names why its trials have no result."""
    run_dir = record_with(tmp_path, ["started", "waiting"])
    submit(run_dir, Chunk([Unit("started", 0), Unit("waiting", 0)], DEAD))
    write_marker(run_dir, marker("t1", "started", DEAD))
    RunPaths(run_dir).trial("t1").mkdir(parents=True)
    log = RunPaths(run_dir).submitit / DEAD / f"{DEAD}_0_log.err"
    log.parent.mkdir(parents=True)
    log.write_text(
        "harbor-hpc: element 1 of 2\n"
        "slurmstepd-vm: error: Detected 1 oom-kill event(s) in StepId=797.batch. Some of your "
        "processes may have been killed by the cgroup out-of-memory handler.\n"
    )
    started, waiting = attempt_statuses(run_dir, load_run(run_dir), set())
    said = "Slurm's cgroup killed 1 process(es) of it for memory"
    assert started.message is not None and waiting.message is not None
    assert started.message.startswith(f"no result: job {DEAD} ended before the trial wrote")
    assert said in started.message and said in waiting.message
    assert (started.failure, waiting.failure) == ("infrastructure", "infrastructure")
    log.write_text("slurmstepd-vm: error: *** JOB 41 ON vm CANCELLED AT 2026-11-28 ***\n")
    started, _ = attempt_statuses(run_dir, load_run(run_dir), set())
    assert started.message is not None and "cancelled, killed" in started.message
