"""submit, status and resubmit against Slurm commands that answer what the test says: what is
asked of sbatch, how a refusal reads, and each attempt's state as jobs live and leave."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_hpc.results.record import (
    Chunk,
    RunPaths,
    Submission,
    cancelled_through,
    load_run,
    update_run,
    write_marker,
)
from harbor_hpc.results.status import attempt_statuses
from harbor_hpc.slurm.cluster import SlurmError, SlurmPlacement
from harbor_hpc.slurm.runs import live_jobs
from harbor_hpc.steps.runs import follow, run_status
from harbor_hpc.steps.submit.launch import resubmit_run, submit_run
from harbor_hpc.steps.submit.options import SubmitOptions
from tests.results.test_status import marker, record_with
from tests.support.cli import cli
from tests.support.fake_slurm import SBATCH_BAD_PARTITION, SBATCH_UNREACHABLE, FakeSlurm
from tests.support.sample_tasks import make_task

TASKS = ("a", "b", "c")


@pytest.fixture
def tasks(tmp_path: Path) -> Path:
    sif = tmp_path / "there.sif"
    sif.write_text("")
    for name in TASKS:
        make_task(tmp_path / "tasks", name, image=str(sif), agent_timeout_sec=60)
    return tmp_path / "tasks"


def options(concurrency: int = 1) -> SubmitOptions:
    return SubmitOptions(
        agent="oracle",
        executor="slurm",
        placement=SlurmPlacement(partition="debug"),
        concurrency=concurrency,
    )


def submitted_run(fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path, concurrency: int = 1) -> Path:
    """The run of `tasks` as submit leaves it on a cluster that queues it as array job 4242."""
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    fake_slurm.answer("sinfo", "2 4000\n")
    run_dir = tmp_path / "run"
    submit_run(tasks, run_dir, options(concurrency=concurrency))
    return run_dir


def by_task(run_dir: Path) -> dict[str, tuple[str, str | None]]:
    return {s.task: (s.state, s.failure) for s in run_status(run_dir).attempts}


def test_a_refused_submission_is_one_line_and_leaves_no_run(
    fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_slurm.answer("sbatch", stderr=SBATCH_BAD_PARTITION.format(partition="debug"), returncode=1)
    run_dir = tmp_path / "run"
    with pytest.raises(SlurmError) as refused:
        submit_run(tasks, run_dir, options())
    assert refused.value.message == (
        "Slurm refused the run's array job: sbatch: error: invalid partition specified: debug "
        "sbatch: error: Batch job submission failed: Invalid partition name specified"
    )
    assert refused.value.exit_code == 2  # the request must change: bad input
    assert not run_dir.exists()  # nothing ran, nothing left: the same submit can run again
    assert capsys.readouterr().err == ""  # sbatch's words once, in the error, not raw before it

    # A controller that cannot be reached is the cluster's failure, not the request's.
    fake_slurm.answer("sbatch", stderr=SBATCH_UNREACHABLE, returncode=1)
    with pytest.raises(SlurmError) as unreachable:
        submit_run(tasks, run_dir, options())
    assert unreachable.value.exit_code == 1
    assert not RunPaths(run_dir).record.exists()


def _two_arrays(fake_slurm: FakeSlurm, tmp_path: Path, second_refused: str) -> Path:
    """Tasks of two sizes (two arrays: big's first), whose second sbatch Slurm refuses so."""
    sif = tmp_path / "there.sif"
    sif.write_text("")
    tasks = tmp_path / "tasks"
    make_task(tasks, "small", image=str(sif), memory_mb=512, agent_timeout_sec=60)
    make_task(tasks, "big", image=str(sif), memory_mb=16384, agent_timeout_sec=60)
    fake_slurm.answer("sinfo", "2 32000\n")
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    fake_slurm.answer("sbatch", stderr=second_refused, returncode=1, call=2)
    return tasks


def test_a_refusal_after_an_array_was_queued_is_a_partial_failure(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    tasks = _two_arrays(
        fake_slurm,
        tmp_path,
        "sbatch: error: Batch job submission failed: Invalid account or account/partition "
        "combination specified\n",
    )
    run_dir = tmp_path / "run"
    with pytest.raises(SlurmError) as refused:
        submit_run(tasks, run_dir, options())
    assert "Invalid account" in refused.value.message
    assert refused.value.exit_code == 1  # one array runs: status and resubmit know it
    [submission] = load_run(run_dir).submissions
    assert [chunk.job for chunk in submission.chunks] == ["4242", None]


def _waiting_run(fake_slurm: FakeSlurm, tmp_path: Path) -> Path:
    """A run of two arrays, the second refused for a limit on queued jobs Slurm's associations
    do not name (a QOS's): sbatch's refusal finds it, and the second array waits."""
    tasks = _two_arrays(
        fake_slurm,
        tmp_path,
        "sbatch: error: QOSMaxSubmitJobPerUserLimit\nsbatch: error: Batch job submission failed: "
        "Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)\n",
    )
    run_dir = tmp_path / "run"
    submitted = submit_run(tasks, run_dir, options())
    assert submitted.queued == 1 and submitted.waiting and "MaxSubmitJobs" in submitted.waiting
    [submission] = load_run(run_dir).submissions
    assert [chunk.job for chunk in submission.chunks] == ["4242", None]  # big goes first
    assert submission.waiting == submitted.waiting
    return run_dir


def test_a_refusal_for_the_users_limit_on_queued_jobs_leaves_the_rest_waiting(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    run_dir = _waiting_run(fake_slurm, tmp_path)
    statuses = attempt_statuses(run_dir, load_run(run_dir), {"4242": None})
    small = next(s for s in statuses if s.task == "small")
    assert small.state == "pending"
    assert (small.message or "").startswith("not queued yet: Slurm's limit")
    # A look at the run queues it once there is room (here: sbatch takes it).
    fake_slurm.answer("squeue", "4242\n")
    assert by_task(run_dir)["small"] == ("pending", None)
    assert [chunk.job for chunk in load_run(run_dir).submissions[0].chunks] == ["4242", "4242"]


def test_a_cancelled_run_queues_nothing_that_waited(fake_slurm: FakeSlurm, tmp_path: Path) -> None:
    run_dir = _waiting_run(fake_slurm, tmp_path)
    fake_slurm.answer("squeue", "4242\n")
    cancelled = cli("cancel", str(run_dir))  # as a trainer's deadline does (cancel_run)
    assert f"cancelled {run_dir}" in cancelled.stderr
    assert fake_slurm.calls("scancel") == [["4242"]]  # the fake cluster's, not a real job 4242
    assert by_task(run_dir)["small"] == ("failed", "infrastructure")
    small = next(s for s in run_status(run_dir).attempts if s.task == "small")
    assert small.message == "not started: a cancel of the run came before it was queued"
    assert [chunk.job for chunk in load_run(run_dir).submissions[0].chunks] == ["4242", None]


def test_status_follows_the_jobs_squeue_knows(
    fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path
) -> None:
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    fake_slurm.answer("sinfo", "2 4000\n")
    run_dir = tmp_path / "run"
    submitted = submit_run(tasks, run_dir, options(concurrency=2))
    assert submitted.job_ids == ["4242"]
    [[script]] = fake_slurm.calls("sbatch")
    sbatch = Path(script).read_text()
    for line in ("--array=0-2", "--partition=debug", "--cpus-per-task=1", "--job-name=harbor"):
        assert f"#SBATCH {line}" in sbatch
    assert "#SBATCH --mem=1536M" in sbatch  # one 512 MB trial and the worker's 1024
    jobs = {chunk.units[0].task: chunk.job for chunk in load_run(run_dir).submissions[0].chunks}
    assert jobs == {"a": "4242_0", "b": "4242_1", "c": "4242_2"}

    fake_slurm.answer("squeue", "4242_[1-2]\n")  # a's element has ended, before its trial
    assert by_task(run_dir) == {
        "a": ("failed", "infrastructure"),
        "b": ("pending", None),
        "c": ("pending", None),
    }
    write_marker(run_dir, marker("b-1", "b", "4242_1"))
    assert by_task(run_dir)["b"] == ("running", None)
    fake_slurm.answer("squeue", "4242_2\n")  # b's element died with its trial
    assert by_task(run_dir)["b"] == ("failed", "infrastructure")

    fake_slurm.answer("sbatch", "Submitted batch job 4300\n")
    again = resubmit_run(run_dir)
    assert sorted(unit.task for unit in again.units) == ["a", "b"]
    assert [status.task for status in again.skipped] == ["c"]  # still queued: left alone
    fake_slurm.answer("squeue", "4242_2\n4300_[0-1]\n")
    assert by_task(run_dir) == {
        "a": ("pending", None),
        "b": ("pending", None),
        "c": ("pending", None),
    }


# What Slurm 22.05's squeue and scancel say when the controller is too busy to answer in time.
SQUEUE_TIMED_OUT = "slurm_load_jobs error: Socket timed out on send/recv operation\n"
SCANCEL_TIMED_OUT = (
    "scancel: error: Kill job error on job id 4242_0: Socket timed out on send/recv operation\n"
)


def test_following_a_run_outlasts_a_controller_that_does_not_answer(
    fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A trainer's batch (or --wait) follows its run while slurmctld stalls: its jobs run on,
    # and no attempt may be taken for failed (or the batch given up) because squeue could not
    # say that they live.
    run_dir = submitted_run(fake_slurm, tasks, tmp_path, concurrency=2)
    fake_slurm.answer("squeue", stderr=SQUEUE_TIMED_OUT, returncode=1)  # from the first call
    statuses = follow(run_dir, every_s=0.1, squeue_every_s=0.2)
    for _ in range(5):
        assert {s.state for s in next(statuses).attempts} == {"pending"}
    assert "Socket timed out" in caplog.text and "going on with its last answer" in caplog.text
    fake_slurm.answer("squeue", "4242_[1-2]\n")  # it answers: a's element has ended
    deadline = time.monotonic() + 10
    while (status := next(statuses)).attempts[0].state == "pending":
        assert time.monotonic() < deadline
    assert [(s.task, s.state) for s in status.attempts] == [
        ("a", "failed"),
        ("b", "pending"),
        ("c", "pending"),
    ]
    assert "Slurm's controller answers again" in caplog.text


def test_a_cancel_holds_while_the_controller_does_not_answer(
    fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path
) -> None:
    # A trainer's deadline cancels its batch while slurmctld stalls: the batch must end with
    # what it has, not with scancel's error; the queued elements see the cancel as they start.
    run_dir = submitted_run(fake_slurm, tasks, tmp_path)
    fake_slurm.answer("scancel", stderr=SCANCEL_TIMED_OUT, returncode=1)
    cancelled = cli("cancel", str(run_dir))
    assert (
        "Socket timed out" in cancelled.stderr and "end at once when they start" in cancelled.stderr
    )
    assert fake_slurm.calls("scancel") == [["4242_0", "4242_1", "4242_2"]]
    assert cancelled_through(run_dir) == 1  # what a worker reads before it runs anything


@pytest.mark.parametrize(("time_min", "warning_s"), [(1, 15), (4, 60), (60, 90)])
def test_the_requeue_warning_leaves_a_short_element_time_to_work(
    fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path, time_min: int, warning_s: int
) -> None:
    # submitit's 90 s warning would reach a one-minute element at once: it would requeue
    # before running anything, forever.
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    chosen = options()
    chosen.placement = SlurmPlacement(partition="debug", time_min=time_min)
    submitted = submit_run(tasks, tmp_path / "run", chosen)
    [[script]] = fake_slurm.calls("sbatch")
    sbatch = Path(script).read_text()
    assert f"#SBATCH --time={time_min}\n" in sbatch
    assert f"#SBATCH --signal=B:USR2@{warning_s}\n" in sbatch
    [group] = submitted.groups  # a --time of the user's splits no tasks
    assert group.requeue_warning_s == warning_s
    # A trial may take its agent's and verifier's timeouts and the environment's start: more
    # than one or four minutes leave before the warning. Said before queueing.
    assert set(group.too_long) == (set(TASKS) if time_min < 60 else set())


def sbatch_lines(fake_slurm: FakeSlurm, prefix: str) -> list[str]:
    """The `#SBATCH PREFIX...` line of every script sbatch was given, in order."""
    return [
        next((line for line in script.splitlines() if line.startswith(f"#SBATCH {prefix}")), "")
        for script in fake_slurm.sbatch_scripts()
    ]


def test_tasks_that_ask_for_more_get_arrays_of_their_own(
    fake_slurm: FakeSlurm, tmp_path: Path
) -> None:
    # One 16 GB task made every element of the run ask for 16 GB.
    sif = tmp_path / "there.sif"
    sif.write_text("")
    tasks = tmp_path / "tasks"
    for name in ("small-1", "small-2"):
        make_task(tasks, name, image=str(sif), memory_mb=512, agent_timeout_sec=60)
    make_task(tasks, "big", image=str(sif), memory_mb=16384, agent_timeout_sec=60)
    gpu = make_task(tasks, "gpu", image=str(sif), memory_mb=512, agent_timeout_sec=60)
    toml = gpu / "task.toml"
    toml.write_text(toml.read_text().replace("cpus = 1\n", "cpus = 1\ngpus = 1\n"))
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    fake_slurm.answer("sinfo", "2 32000\n")
    chosen = options(concurrency=2)
    chosen.tasks_per_job = 2
    run_dir = tmp_path / "run"
    submitted = submit_run(tasks, run_dir, chosen)
    # The two small tasks share an element of two trials at a time; the others run alone.
    memory = {"big": 16384 + 1024, "gpu": 512 + 1024, "small-1": 2 * 512 + 1024}
    assert {group.tasks[0]: group.resources.mem_mb for group in submitted.groups} == memory
    assert [group.tasks for group in submitted.groups if len(group.tasks) > 1] == [
        ["small-1", "small-2"]
    ]
    assert sorted(sbatch_lines(fake_slurm, "--mem=")) == sorted(
        f"#SBATCH --mem={mb}M" for mb in memory.values()
    )
    assert sbatch_lines(fake_slurm, "--gres=").count("#SBATCH --gres=gpu:1") == 1
    recorded = {
        unit.task: chunk.resources["mem_mb"]
        for chunk in load_run(run_dir).submissions[0].chunks
        for unit in chunk.units
    }
    assert recorded == {**memory, "small-2": memory["small-1"]}

    # The jobs are gone without a trial: resubmit sizes what it queues again the same way.
    again = resubmit_run(run_dir)
    assert len(again.units) == 4
    assert sorted(sbatch_lines(fake_slurm, "--mem=")[3:]) == sorted(
        sbatch_lines(fake_slurm, "--mem=")[:3]
    )

    # What the user gives, every element asks for: it splits no tasks (the gpu one still is).
    chosen.mem_mb = 4000
    planned = submit_run(tasks, tmp_path / "other", chosen, dry_run=True)
    assert [(g.tasks, g.resources.mem_mb) for g in planned.groups] == [
        (["big", "small-1", "small-2"], 4000),
        (["gpu"], 4000),
    ]


def test_status_stops_at_a_controller_that_does_not_answer(
    fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path
) -> None:
    fake_slurm.answer("sbatch", "Submitted batch job 4242\n")
    run_dir = tmp_path / "run"
    submit_run(tasks, run_dir, options())
    fake_slurm.answer(
        "squeue", stderr="slurm_load_jobs error: Socket timed out on send/recv\n", returncode=1
    )
    with pytest.raises(SlurmError, match=r"`squeue .*` failed: .*Socket timed out"):
        run_status(run_dir)


@pytest.fixture
def processes() -> Iterator[tuple[int, int]]:
    """A live process and a finished one, for local jobs."""
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    yield live.pid, dead.pid
    live.kill()
    live.wait()


def test_a_local_job_lives_as_long_as_its_process(
    tmp_path: Path, processes: tuple[int, int]
) -> None:
    run_dir = record_with(tmp_path, ["a"])
    live, dead = (str(pid) for pid in processes)
    with update_run(run_dir) as record:
        record.submissions = [
            Submission(1, "local", socket.gethostname(), "t", [Chunk([], live)]),
            Submission(2, "local", socket.gethostname(), "t", [Chunk([], dead)]),
            Submission(3, "local", "another-host", "t", [Chunk([], "1")]),
        ]
    # From another host a local job's fate cannot be seen: it counts as alive.
    assert set(live_jobs(load_run(run_dir))) == {live, "1"}


def test_following_a_run_asks_squeue_less_and_less_often(
    fake_slurm: FakeSlurm, tasks: Path, tmp_path: Path
) -> None:
    # Admins throttle users whose polling loads slurmctld: --wait and the Python API ask squeue
    # after squeue_every_s, then twice as long each time, up to four times as long.
    run_dir = submitted_run(fake_slurm, tasks, tmp_path, concurrency=2)
    fake_slurm.answer("squeue", "4242_[0-2]\n")  # pending for ever
    asked = len(fake_slurm.calls("squeue"))
    began = time.monotonic()
    for _ in follow(run_dir, every_s=0.05, squeue_every_s=0.5):
        if time.monotonic() - began > 6.0:
            break
    # At 0 (the first look), 0.5, 1.5, 3.5 and 5.5 s: five (fewer on a slow machine, never
    # more), where every 0.5 s would be twelve.
    assert 3 <= len(fake_slurm.calls("squeue")) - asked <= 5
