"""A cluster with the low limits many sites set (.ci/provision.sh's cluster `harbor-hpc-limits`:
MaxArraySize=100, and MaxSubmitJobs=20 for each test user through Slurm's accounting): a run
with more elements than the user may queue is queued in waves, each element once, and
completes; while elements wait, `status` says why."""

from __future__ import annotations

import getpass
import os
import subprocess
import time
from pathlib import Path

import pytest

from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.results.record import load_run
from harbor_hpc.slurm import cluster
from tests.support.cli import cli, cli_json
from tests.support.sample_tasks import make_task

pytestmark = [pytest.mark.limits, pytest.mark.apptainer, pytest.mark.harbor]

# What .ci/provision.sh sets on that cluster.
MAX_SUBMIT_JOBS = 20
MAX_ARRAY_SIZE = 100


@pytest.fixture
def low_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """This test's Slurm commands, and those of the CLI it runs, go to the cluster with low
    limits; none of this user's jobs is queued there (another test's would take room)."""
    monkeypatch.setenv("SLURM_CONF", os.environ["HARBOR_HPC_TEST_LIMITS_SLURM_CONF"])
    assert cluster.max_array_size() == MAX_ARRAY_SIZE
    deadline = time.monotonic() + 120
    while cluster.submit_room(getpass.getuser()) != MAX_SUBMIT_JOBS:
        assert time.monotonic() < deadline, "jobs of this user stay queued on the limits cluster"
        time.sleep(2)


def _tasks(root: Path, count: int, image: Path) -> Path:
    for i in range(count):
        make_task(root, f"t{i:03d}", image=str(image), agent_timeout_sec=60)
    return root


def _each_unit_ran_once(run_dir: Path) -> None:
    record = load_run(run_dir)
    started = sorted((m.task, m.attempt) for m in RunTrials(run_dir, reward_key=None).markers)
    assert started == sorted((u.task, u.attempt) for u in record.units())
    jobs = [chunk.job for sub in record.submissions for chunk in sub.chunks]
    assert None not in jobs and len(set(jobs)) == len(jobs)
    assert all(sub.waiting is None for sub in record.submissions)


@pytest.mark.usefixtures("low_limits")
def test_more_elements_than_the_user_may_queue_run_in_waves_with_submit_wait(
    debian_sif: Path, tmp_path: Path
) -> None:
    tasks = _tasks(tmp_path / "tasks", 30, debian_sif)
    run_dir = tmp_path / "run"
    argv = ["submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir)]
    argv += ["--executor", "slurm", "--tasks-per-job", "1", "--attempts", "2", "-c", "2"]
    # The doctor and a dry run say it first.
    limits = {c["check"]: c for c in cli_json("doctor")}["job limits"]
    assert f"arrays of up to {MAX_ARRAY_SIZE} elements" in limits["detail"]
    assert f"you may queue {MAX_SUBMIT_JOBS} more job(s) now" in limits["detail"]
    planned = cli(*argv, "--dry-run").stderr
    assert "10 elements would wait to be queued: Slurm's limit" in planned
    assert not run_dir.exists()
    done = cli(*argv, "--wait", check=False)
    assert done.returncode == 0, done.stderr
    # 30 elements, 20 queued at first: the rest waited, and said so.
    assert "60 trial(s) in 30 element(s)" in done.stderr
    assert "10 elements not queued yet: Slurm's limit on your queued jobs" in done.stderr
    statuses = cli_json("status", str(run_dir))
    assert {(s["state"], s["reward"]) for s in statuses} == {("done", 1.0)}
    assert len(statuses) == 60
    _each_unit_ran_once(run_dir)


@pytest.mark.usefixtures("low_limits")
def test_status_says_what_waits_and_queues_it_as_room_frees(
    debian_sif: Path, tmp_path: Path
) -> None:
    tasks = _tasks(tmp_path / "tasks", 40, debian_sif)
    run_dir = tmp_path / "run"
    argv = ["submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir)]
    # All places but one taken by held jobs of the user's: one element of the run goes out,
    # and it holds the one place until it has left the queue (an element frees none for its
    # own end to fill): the rest waits when status looks, however fast that element ran.
    held = subprocess.run(
        ["sbatch", "--hold", "--parsable", "-o", "/dev/null", "--array=0-18", "--wrap", "true"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        cli(*argv, "--executor", "slurm", "--tasks-per-job", "1")
        waiting = [s for s in cli_json("status", str(run_dir)) if s["state"] == "pending"]
    finally:
        cluster.cancel(held.stdout.strip().split(";")[0])
    said = {s["message"] for s in waiting if (s["message"] or "").startswith("not queued yet")}
    assert len(said) == 1 and "MaxSubmitJobs" in said.pop()
    assert len([s for s in waiting if (s["message"] or "").startswith("not queued")]) >= 38
    # The held jobs gone, each look at the run queues what now fits (and so does each element
    # as it ends).
    deadline = time.monotonic() + 600
    while True:
        statuses = cli_json("status", str(run_dir))
        if all(s["state"] in ("done", "failed") for s in statuses):
            break
        assert time.monotonic() < deadline, [s for s in statuses if s["state"] != "done"][:3]
        time.sleep(3)
    failed = [s for s in statuses if s["state"] != "done"]
    assert {(s["state"], s["reward"]) for s in statuses} == {("done", 1.0)}, failed
    _each_unit_ran_once(run_dir)


@pytest.mark.usefixtures("low_limits")
def test_waves_go_on_with_nobody_looking_at_the_run(debian_sif: Path, tmp_path: Path) -> None:
    """Submitted and left: each element, once its trials ended, queues what now fits."""
    tasks = _tasks(tmp_path / "tasks", 30, debian_sif)
    run_dir = tmp_path / "run"
    argv = ["submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir)]
    submitted = cli(*argv, "--executor", "slurm", "--tasks-per-job", "1")
    assert "10 elements not queued yet" in submitted.stderr
    # Only Slurm is asked from here (status would queue the waves itself).
    deadline = time.monotonic() + 600
    while True:
        record = load_run(run_dir)
        jobs = [c.job for sub in record.submissions for c in sub.chunks if c.job]
        if not record.submissions[0].waits and not cluster.queued_jobs(jobs):
            break
        assert time.monotonic() < deadline, f"{len(jobs)} of 30 elements queued"
        time.sleep(3)
    statuses = cli_json("status", str(run_dir))
    assert {(s["state"], s["reward"]) for s in statuses} == {("done", 1.0)}
    _each_unit_ran_once(run_dir)


@pytest.mark.usefixtures("low_limits")
def test_a_wrong_partition_is_refused_even_when_nothing_could_be_queued(
    debian_sif: Path, tmp_path: Path
) -> None:
    # The user's queue is full: nothing of the run can go out now, yet a partition Slurm does not
    # take is said now (sbatch --test-only), not at a later wave the run could never pass.
    held = subprocess.run(
        ["sbatch", "--hold", "--parsable", "-o", "/dev/null", "--array=0-19", "--wrap", "true"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    try:
        tasks = _tasks(tmp_path / "tasks", 2, debian_sif)
        run_dir = tmp_path / "run"
        argv = ["submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir)]
        refused = cli(*argv, "--executor", "slurm", "--partition", "nosuch", check=False)
        assert refused.returncode == 2, refused.stderr
        assert "invalid partition specified: nosuch" in refused.stderr
        assert not run_dir.exists()  # nothing half-made: the same submit, fixed, runs again
        waits = cli(*argv, "--executor", "slurm", "--partition", "limits")
        assert "2 elements not queued yet" in waits.stderr
        assert cli_json("status", str(run_dir))[0]["state"] == "pending"
    finally:
        cluster.cancel(held.stdout.strip().split(";")[0])
