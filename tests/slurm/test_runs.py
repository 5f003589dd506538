"""End to end on the real one-node Slurm with Apptainer: submit, status, resubmit, export.

Tasks run the oracle agent in harbor-hpc's environment on a .sif of the test base image. The
machine has 2 cores, so trials run 2 at a time with short timeouts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from harbor_hpc.api import InputError, Progress, RolloutRequest, run_rollouts
from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.results.record import RunPaths, load_run
from harbor_hpc.slurm.cluster import queued_jobs
from tests.support import installed_agent
from tests.support.cli import cli, cli_json
from tests.support.probe_agent import AGENT, seen_by
from tests.support.processes import gone_within, job_processes, named, processes_naming
from tests.support.sample_tasks import make_task
from tests.support.small_disk import fill, small_disk, unfill
from tests.support.users import other_user_command

pytestmark = [pytest.mark.slurm, pytest.mark.apptainer, pytest.mark.docker]

SOLVED = [f"solved-{i:02d}" for i in range(3)]
EXPECTED = {
    **{name: ("done", 1.0, None) for name in SOLVED},
    "unsolved": ("done", 0.0, None),
    "hog": ("failed", None, "memory"),
    "slow": ("failed", None, "timeout"),
    "noimage": ("failed", None, "image"),
    "gone": ("failed", None, "image"),
}


# The fake GPUs' device files (.ci/provision.sh).
FAKE_GPUS = ("/dev/harbor-hpc-gpu0", "/dev/harbor-hpc-gpu1")


def by_task(statuses: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["task"]: s for s in statuses}


def job_state(job: str) -> str:
    """The job's state and why it waits, as squeue says (`PENDING BeginTime`)."""
    command = ["squeue", "-h", "-j", job, "-o", "%T %r"]
    return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip()


@pytest.fixture(scope="module")
def suite_run(debian_sif: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("suite")
    tasks = root / "tasks"
    for name in SOLVED:
        make_task(tasks, name, image=str(debian_sif), agent_timeout_sec=30, verifier_timeout_sec=30)
    make_task(
        tasks,
        "unsolved",
        kind="unsolved",
        image=str(debian_sif),
        agent_timeout_sec=30,
        verifier_timeout_sec=30,
    )
    make_task(
        tasks,
        "hog",
        kind="dev_hog",
        memory_mb=96,
        image=str(debian_sif),
        agent_timeout_sec=30,
        verifier_timeout_sec=30,
    )
    make_task(tasks, "slow", kind="slow", image=str(debian_sif), agent_timeout_sec=3)
    make_task(tasks, "noimage", image=None)
    make_task(tasks, "gone", image=str(root / "missing.sif"))
    run_dir = root / "run"
    waited = cli(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "slurm", "--concurrency", "2", "--tasks-per-job", "3", "--wait", "--json",
        check=False,
    )  # fmt: skip
    # Some attempts failed: --wait names them by failure class and exits 1.
    assert waited.returncode == 1, waited.stderr
    for line in (
        "  image (2): gone #0, noimage #0",
        "  memory (1): hog #0",
        "  timeout (1): slow #0",
    ):
        assert f"\n{line}\n" in waited.stderr, waited.stderr
    submitted = json.loads(waited.stdout)
    assert sorted(submitted["image_problems"]) == ["gone", "noimage"]
    # The five tasks that ask alike (times grouped to the quarter hour) share two elements;
    # hog (less memory) has one of its own.
    assert submitted["trials"] == 6 and submitted["elements"] == 3
    return run_dir


def test_rewards_and_failure_classes(suite_run: Path) -> None:
    statuses = by_task(cli_json("status", str(suite_run)))
    got = {task: (s["state"], s["reward"], s["failure"]) for task, s in statuses.items()}
    expected = {task: want for task, want in EXPECTED.items()}
    # A timed-out agent still gets verified; only its class matters here.
    got["slow"] = (got["slow"][0], None, got["slow"][2])
    assert got == expected
    assert "MemoryLimitExceededError" in statuses["hog"]["message"]
    assert "AgentTimeoutError" in statuses["slow"]["message"]
    for task in SOLVED:
        trial_dir = RunPaths(suite_run).trial(statuses[task]["trial"])
        assert (trial_dir / "result.json").is_file() and (trial_dir / "trial.log").is_file()
    record = load_run(suite_run)
    assert len(record.submissions) == 1 and record.submissions[0].job_ids
    table = cli("status", str(suite_run)).stdout
    assert "mean reward 0.750" in table  # 3 solved of 4 that ran to a reward


def not_allowed(mode: int, path: Path) -> int:
    """The permission bits of `path` beyond `mode`."""
    return stat.S_IMODE(path.lstat().st_mode) & ~mode


@pytest.mark.other_user
def test_a_run_is_its_owners_alone(suite_run: Path) -> None:
    assert stat.S_IMODE(suite_run.stat().st_mode) == 0o700
    trials = RunPaths(suite_run).trials
    # Harbor makes trial folders 0777; the worker seals them.
    assert [p for p in [trials, *trials.rglob("*")] if not_allowed(0o700, p)] == []
    result = next(trials.glob("*/result.json"))
    for argv in (
        ["cat", str(RunPaths(suite_run).record)],
        ["ls", str(trials)],
        ["sh", "-c", f"echo 0 > {result}"],
    ):
        tried = subprocess.run(other_user_command(argv), capture_output=True, text=True)
        assert tried.returncode != 0 and "Permission denied" in tried.stderr, argv
    status = [sys.executable, "-m", "harbor_hpc", "status", str(suite_run)]
    refused = subprocess.run(other_user_command(status), capture_output=True, text=True)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    # One line naming the run folder, or the private folder above it that is in the way.
    assert refused.stderr.startswith(f"error: {suite_run}: "), refused.stderr
    assert "may not" in refused.stderr.splitlines()[0], refused.stderr


def test_two_submits_at_once_queue_each_attempt_once(debian_sif: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    for name in ("one", "two"):
        make_task(tasks, name, image=str(debian_sif), agent_timeout_sec=30)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "harbor_hpc", "submit", str(tasks), "--agent", "oracle"]
    argv += ["--run-dir", str(run_dir), "--executor", "slurm", "--group-readable"]
    submits = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for submit in submits:
        _, err = submit.communicate(timeout=120)
        # The one that finds the other at work says so; one that comes after it queues nothing.
        assert submit.returncode == 0 or "another submit or resubmit" in err, err
    record = load_run(run_dir)
    queued = [unit for sub in record.submissions for chunk in sub.chunks for unit in chunk.units]
    assert sorted(queued) == sorted(record.units())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and queued_jobs(record.submissions[0].job_ids):
        time.sleep(1)
    assert {s["state"] for s in cli_json("status", str(run_dir))} == {"done"}
    # Readable by the group, writable by no one else.
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o750
    trials = RunPaths(run_dir).trials
    assert [p for p in [trials, *trials.rglob("*")] if not_allowed(0o750, p)] == []


def test_a_run_submitted_from_inside_an_array_element_runs_its_own_tasks(
    debian_sif: Path, tmp_path: Path
) -> None:
    """From an element of the user's own array (what an element queueing the next wave is): the
    run's single element is a plain job, which must not take the outer element's array ids
    (submitit would run that element's work, not its own)."""
    tasks = tmp_path / "tasks"
    make_task(tasks, "inner", image=str(debian_sif), agent_timeout_sec=60)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "harbor_hpc", "submit", str(tasks), "--agent", "oracle"]
    argv += ["--run-dir", str(run_dir), "--executor", "slurm", "--wait"]
    outer = subprocess.run(
        ["sbatch", "--parsable", "--array=3-3", "--mem=512M", "-o", str(tmp_path / "outer.log"),
         "--wrap", " ".join(argv)],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    wait_for_jobs([outer.stdout.strip()], time.monotonic() + 300)
    said = (tmp_path / "outer.log").read_text()
    [status] = cli_json("status", str(run_dir))
    assert (status["state"], status["reward"]) == ("done", 1.0), (status, said)


def test_a_secret_reaches_the_agent_and_no_file(debian_sif: Path, tmp_path: Path) -> None:
    """An installed agent (it runs in the container) gets its variables there, and said them
    there: Harbor's redaction hides the secret in its files, and leaves the placeholder `none`
    (OPENAI_API_KEY's value for a server without keys) and words like it as they were."""
    make_task(tmp_path / "tasks", "secret", kind="secret", image=str(debian_sif))
    run = ["submit", str(tmp_path / "tasks"), "--agent", installed_agent.AGENT, "--run-dir"]
    run += [str(tmp_path / "run"), "--executor", "slurm"]
    refused = cli(*run, "--agent-kwarg", "api_key=s3cr3t-2f9a", check=False)
    assert refused.returncode == 2 and "--agent-env NAME" in refused.stderr, refused.stderr
    assert not (tmp_path / "run").exists()

    given = ["--agent-env", "HH_TEST_SECRET=s3cr3t-2f9a", "--agent-env", "OPENAI_API_KEY=none"]
    submitted = cli(*run, *given, "--wait", "--json")
    assert "s3cr3t" not in submitted.stdout + submitted.stderr
    [status] = cli_json("status", str(tmp_path / "run"))
    assert (status["state"], status["reward"]) == ("done", 1.0), status
    files = [path for path in (tmp_path / "run").rglob("*") if path.is_file()]
    assert [path for path in files if b"s3cr3t" in path.read_bytes()] == []
    said = tmp_path / "run" / "trials" / status["trial"] / "agent" / installed_agent.SAID_FILE
    assert said.read_text() == "secret=[REDACTED] key=none\n--network none, EMPTY, dummy\n"
    assert load_run(tmp_path / "run").agent_env == ["HH_TEST_SECRET", "OPENAI_API_KEY"]


def test_every_element_runs_the_sites_setup_lines_first(debian_sif: Path, tmp_path: Path) -> None:
    """`setup` lines from harbor-hpc.toml, then `--setup` ones: a `module`-like function one
    line defines, called by the next, in every array element; the run records them for resubmit."""
    mark = tmp_path / "setup-ran"
    config = tmp_path / "harbor-hpc.toml"
    line = f'site_module() {{ echo "loaded $* in $SLURM_ARRAY_TASK_ID" >> {mark}; }}'
    config.write_text(f"setup = [{json.dumps(line)}]\n")
    env = {**os.environ, "HARBOR_HPC_CONFIG": str(config)}
    for name in ("one", "two"):
        make_task(tmp_path / "tasks", name, image=str(debian_sif))
    run_dir = tmp_path / "run"
    cli("submit", str(tmp_path / "tasks"), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "slurm", "--tasks-per-job", "1", "--setup", "site_module apptainer",
        "--wait", env=env)  # fmt: skip
    assert sorted(mark.read_text().splitlines()) == [
        "loaded apptainer in 0",
        "loaded apptainer in 1",
    ]
    assert load_run(run_dir).options["setup"] == [line, "site_module apptainer"]


def test_tasks_asking_for_different_memory_run_in_arrays_sized_for_each(
    debian_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every element was sized for the run's largest task. The probe agent (import path) takes
    # collect_rollout_details and writes down how litellm loaded its cost map in the worker.
    monkeypatch.delenv("LITELLM_LOCAL_MODEL_COST_MAP", raising=False)
    tasks = tmp_path / "tasks"
    for name, memory_mb in (("large", 1024), ("small", 256)):
        make_task(tasks, name, image=str(debian_sif), memory_mb=memory_mb, agent_timeout_sec=30)
    run_dir = tmp_path / "run"
    # --wait exits 0: every attempt done.
    submitted = cli_json(
        "submit", str(tasks), "--agent", AGENT, "--run-dir", str(run_dir), "--executor", "slurm",
        "--wait",
    )  # fmt: skip
    assert submitted["agent_kwargs"] == {"collect_rollout_details": True}
    memory = {"large": 1024 + 1024, "small": 256 + 1024}  # a trial's, and the worker's
    groups = submitted["groups"]
    assert {group["tasks"][0]: group["resources"]["mem_mb"] for group in groups} == memory
    # What Slurm was given: one array each, its own size.
    scripts = [path.read_text() for path in RunPaths(run_dir).submitit.rglob("*_submission.sh")]
    assert sorted(line for s in scripts for line in s.splitlines() if "--mem=" in line) == [
        f"#SBATCH --mem={memory['small']}M",
        f"#SBATCH --mem={memory['large']}M",
    ]
    statuses = by_task(cli_json("status", str(run_dir)))
    assert {t: (s["state"], s["reward"]) for t, s in statuses.items()} == {
        "large": ("done", 1.0),
        "small": ("done", 1.0),
    }

    # A resubmit's jobs get the variable from no submit (it imports no agent): the worker sets it.
    # (Once their jobs have left the queue: --wait is done when the trials are, a job may stay a
    # moment after, and resubmit leaves a live job's attempt alone.)
    wait_for_jobs(submitted["job_ids"], time.monotonic() + 60)
    victim = statuses["small"]["trial"]
    shutil.rmtree(RunPaths(run_dir).trial(victim))
    assert cli_json("resubmit", str(run_dir), "--wait")["trials"] == 1
    trials = [RunPaths(run_dir).trial(s["trial"]) for s in cli_json("status", str(run_dir))]
    assert victim not in {trial.name for trial in trials}
    for trial in trials:
        seen = seen_by(trial)
        assert seen["collect_rollout_details"] is True
        assert seen["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
        assert seen["cost_map"]["is_env_forced"] and seen["cost_map"]["url"] is None, seen


def test_export_writes_one_rollout_per_trial(suite_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "rollouts.jsonl"
    # Six trials, and the two attempts that never ran for want of an image.
    assert cli_json("export", str(suite_run), "--out", str(out))["rollouts"] == 8
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["task"] for line in lines) == sorted(EXPECTED)
    assert all(line["counts"] for line in lines)  # one trial per attempt, none superseded
    untrainable = {line["task"] for line in lines if not line["trainable"]}
    assert untrainable == {"hog", "noimage", "gone"}  # the timed-out agent's is kept, partial
    assert [line["task"] for line in lines if line["partial"]] == ["slow"]
    assert {line["trial"] for line in lines if line["task"] in ("noimage", "gone")} == {None}
    solved = next(line for line in lines if line["task"] == SOLVED[0])
    assert solved["reward"] == 1.0 and solved["agent"] == "oracle"
    assert solved["timings"]["agent_execution"] is not None
    assert solved["instruction"].startswith("Write 42")


def test_a_deleted_trial_is_restored_by_resubmit_and_nothing_else_reruns(suite_run: Path) -> None:
    # A run's trials end before its jobs do: a job still queued would have the trial running.
    jobs = [chunk.job for sub in load_run(suite_run).submissions for chunk in sub.chunks]
    assert gone_within(120, lambda: sorted(queued_jobs([job for job in jobs if job]))) == []
    before = by_task(cli_json("status", str(suite_run)))
    victim = before[SOLVED[1]]["trial"]
    shutil.rmtree(RunPaths(suite_run).trial(victim))
    lost = by_task(cli_json("status", str(suite_run)))[SOLVED[1]]
    assert (lost["state"], lost["failure"]) == ("failed", "infrastructure")
    markers_before = len(RunTrials(suite_run, reward_key=None).markers)

    waited = cli("resubmit", str(suite_run), "--wait", "--json", check=False)
    assert waited.returncode == 1, waited.stderr  # the failed attempts still are
    resubmitted = json.loads(waited.stdout)
    # The lost trial, plus the two tasks whose image is still missing (rechecked, not run).
    assert resubmitted["trials"] == 1
    assert sorted(resubmitted["image_problems"]) == ["gone", "noimage"]
    after = by_task(cli_json("status", str(suite_run)))
    assert after[SOLVED[1]]["state"] == "done" and after[SOLVED[1]]["trial"] != victim
    assert len(RunTrials(suite_run, reward_key=None).markers) == markers_before + 1
    for task, status in after.items():
        if task != SOLVED[1]:
            assert status == before[task], task

    # --failed reruns the failed trials that ran (memory, timeout), not the done ones.
    dry = cli_json("resubmit", str(suite_run), "--failed", "--dry-run")
    assert dry["trials"] == 2


def test_a_cancelled_job_is_finished_by_resubmit(debian_sif: Path, tmp_path: Path) -> None:
    run_dir, tasks, jobs = start_two_trials(debian_sif, tmp_path, "sleepy")
    running = cli_json("status", str(run_dir))
    assert {s["state"] for s in running} == {"running"}
    # The job's end takes every process of it (proctrack/cgroup): its containers' agents too.
    deadline = time.monotonic() + 120
    held = job_processes(jobs[0])
    while list(named(held).values()).count("sleep") < len(TWO):
        assert time.monotonic() < deadline, "the agents' commands never ran"
        time.sleep(0.5)
        held = job_processes(jobs[0])
    subprocess.run(["scancel", *jobs], check=True, timeout=30)
    wait_for_jobs(jobs, time.monotonic() + 120)
    assert psutil.wait_procs(held, timeout=30)[1] == []
    dead = cli_json("status", str(run_dir))
    assert {(s["state"], s["failure"]) for s in dead} == {("failed", "infrastructure")}
    done = rerun_to_reward_one(run_dir, tasks, debian_sif, {s["trial"] for s in dead})
    # Export agrees with status: the cancelled trials (if they left a result) do not count.
    out = tmp_path / "rollouts.jsonl"
    cli_json("export", str(run_dir), "--out", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {line["trial"] for line in lines if line["counts"]} == {s["trial"] for s in done}
    assert {line["failure"] for line in lines if not line["counts"]} <= {"infrastructure"}


def test_a_requeued_job_resumes_its_chunk_without_rerunning_finished_trials(
    debian_sif: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    make_task(tasks, "a-quick", image=str(debian_sif), agent_timeout_sec=60)
    make_task(tasks, "b-sleepy", kind="sleepy", image=str(debian_sif), agent_timeout_sec=60)
    run_dir = tmp_path / "run"
    submitted = cli_json(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "slurm", "--concurrency", "1", "--tasks-per-job", "2",
    )  # fmt: skip
    (job,) = submitted["job_ids"]
    deadline = time.monotonic() + 120
    while len(RunTrials(run_dir, reward_key=None).markers) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)  # the quick one is done once the sleepy one has started
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
    # Slurm holds a requeued job for two minutes (its credentials' lifetime); what is tested
    # here is what happens after. The hold is set once the killed job has ended: lifted any
    # earlier, it is set again and the test waits the two minutes.
    while job_state(job) != "PENDING BeginTime" and time.monotonic() < deadline:
        time.sleep(0.2)
    # The node revokes the killed run's credentials by time, to the second: a credential made in
    # the same second counts as revoked ("Job credential revoked") and the job is killed before
    # it starts. Lifting the hold two seconds on issues a credential of a later second.
    time.sleep(2)
    make_task(tasks, "b-sleepy", image=str(debian_sif), agent_timeout_sec=60)  # now quick
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)
    while queued_jobs([job]) and time.monotonic() < deadline + 60:
        time.sleep(0.5)
    statuses = by_task(cli_json("status", str(run_dir)))
    assert {t: (s["state"], s["reward"]) for t, s in statuses.items()} == {
        "a-quick": ("done", 1.0),
        "b-sleepy": ("done", 1.0),
    }
    markers = RunTrials(run_dir, reward_key=None).markers
    assert [m.task for m in markers].count("a-quick") == 1  # never run twice
    assert [m.task for m in markers].count("b-sleepy") == 2  # cut off, then run again


TWO = ("first", "second")


def start_two_trials(debian_sif: Path, tmp_path: Path, kind: str) -> tuple[Path, Path, list[str]]:
    """Two tasks of `kind` in one element, both trials started: the run, its tasks, its jobs.
    The run folder is `tmp_path/run` unless `tmp_path` already holds one (a disk of its own)."""
    tasks = tmp_path / "tasks"
    for name in TWO:
        make_task(tasks, name, kind=kind, image=str(debian_sif), agent_timeout_sec=60)
    run_dir = tmp_path / "run"
    submitted = cli_json(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "slurm", "--concurrency", "2", "--tasks-per-job", "2",
    )  # fmt: skip
    jobs: list[str] = submitted["job_ids"]
    deadline = time.monotonic() + 180
    while len(RunTrials(run_dir, reward_key=None).markers) < 2:
        assert time.monotonic() < deadline, "the trials never started"
        assert queued_jobs(jobs), f"jobs {jobs} ended before their trials started"
        time.sleep(0.5)
    return run_dir, tasks, jobs


def wait_for_jobs(job_ids: list[str], deadline: float) -> None:
    while queued_jobs(job_ids):
        assert time.monotonic() < deadline, f"jobs {job_ids} never ended"
        time.sleep(0.5)


def rerun_to_reward_one(
    run_dir: Path, tasks: Path, debian_sif: Path, old: set[str]
) -> list[dict[str, Any]]:
    """`resubmit` finishes the run: every task done with reward 1, in new trials, each task run
    once more and no more, the failed trials kept. The tasks become quick ones first: the
    reruns need not wait (changed tasks, which resubmit runs again when told so)."""
    for name in TWO:
        make_task(tasks, name, image=str(debian_sif), agent_timeout_sec=60)
    cli("resubmit", str(run_dir), "--rerun-changed", "--wait", "--json")
    done: list[dict[str, Any]] = cli_json("status", str(run_dir))
    assert {(s["state"], s["reward"]) for s in done} == {("done", 1.0)}, done
    assert not old & {s["trial"] for s in done}
    assert all(RunPaths(run_dir).trial(trial).is_dir() for trial in old)  # kept, not reused
    counted = [m.task for m in RunTrials(run_dir, reward_key=None).markers]
    assert sorted(counted) == sorted([*TWO, *TWO])  # once cut short, once done
    return done


def test_a_killed_worker_is_finished_by_resubmit(debian_sif: Path, tmp_path: Path) -> None:
    run_dir, tasks, jobs = start_two_trials(debian_sif, tmp_path, "sleepy")
    workers = processes_naming(str(run_dir), "submitit")
    assert workers, "no worker process found"
    killed = 0
    for worker in workers:
        # What matched may include a short-lived process of the job's, gone by now.
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.send_signal(signal.SIGKILL)
            killed += 1
    assert killed, f"every worker process had ended before it was killed: {workers}"
    wait_for_jobs(jobs, time.monotonic() + 120)
    dead = cli_json("status", str(run_dir))
    assert {(s["state"], s["failure"]) for s in dead} == {("failed", "infrastructure")}, dead
    rerun_to_reward_one(run_dir, tasks, debian_sif, {s["trial"] for s in dead})


@pytest.mark.small_disk
def test_a_disk_full_during_trials_is_finished_by_resubmit(
    debian_sif: Path, tmp_path: Path
) -> None:
    with small_disk(tmp_path, megabytes=64) as disk:
        run_dir, tasks, jobs = start_two_trials(debian_sif, disk, "pausing")
        fill(disk)  # while both agents are at work
        wait_for_jobs(jobs, time.monotonic() + 180)
        unfill(disk)
        full = cli_json("status", str(run_dir))
        assert {s["state"] for s in full} == {"failed"}, full
        assert {s["failure"] for s in full} <= {"infrastructure", "environment"}, full
        rerun_to_reward_one(run_dir, tasks, debian_sif, {s["trial"] for s in full})


@pytest.mark.apptainer_only  # enroot's containers get no GPUs yet (refused in one line)
def test_tasks_asking_for_gpus_get_their_own_from_slurm(debian_sif: Path, tmp_path: Path) -> None:
    """The node's GPUs are fake (GRES type `fake`, .ci/provision.sh): Slurm is asked for the
    type as it names it, and each of two trials at once gets one device of its element's two;
    a task that asks for none sees none. The device files reach the containers as a site's
    APPTAINER_BINDPATH binds them (a setup line), and the job's device cgroup (ConstrainDevices)
    holds the containers as it holds the job: the GPU element may open both, the other none."""
    tasks = tmp_path / "tasks"
    for name in ("gpu-a", "gpu-b"):
        make_task(
            tasks, name, kind="one_gpu", image=str(debian_sif), agent_timeout_sec=30,
            gpus=1, gpu_types=["FAKE"],
        )  # fmt: skip
    make_task(tasks, "cpu", kind="one_gpu", image=str(debian_sif), agent_timeout_sec=30)
    run_dir = tmp_path / "run"
    submitted = cli_json(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir), "--executor",
        "slurm", "--tasks-per-job", "2", "--concurrency", "2", "--wait",
        "--setup", f"export APPTAINER_BINDPATH={FAKE_GPUS[0]},{FAKE_GPUS[1]}",
    )  # fmt: skip
    asked = {
        tuple(g["tasks"]): (g["resources"]["gpus"], g["resources"]["gpu_types"])
        for g in submitted["groups"]
    }
    assert asked == {("gpu-a", "gpu-b"): (2, ["fake"]), ("cpu",): (0, [])}
    scripts = [path.read_text() for path in RunPaths(run_dir).submitit.rglob("*_submission.sh")]
    gres = [line for script in scripts for line in script.splitlines() if "--gres" in line]
    assert gres == ["#SBATCH --gres=gpu:fake:2"]
    statuses = by_task(cli_json("status", str(run_dir)))
    rewards = {task: (status["state"], status["reward"]) for task, status in statuses.items()}
    assert rewards == {"gpu-a": ("done", 1.0), "gpu-b": ("done", 1.0), "cpu": ("done", 0.0)}
    seen = {
        task: (RunPaths(run_dir).trial(status["trial"]) / "agent" / "gpus").read_text().strip()
        for task, status in statuses.items()
    }
    assert sorted([seen["gpu-a"], seen["gpu-b"]]) == ["0", "1"] and seen["cpu"] == ""
    opened = {
        task: (RunPaths(run_dir).trial(status["trial"]) / "agent" / "devices").read_text()
        for task, status in statuses.items()
    }
    given, refused = "No such device or address", "Operation not permitted"
    for task, said in (("gpu-a", given), ("gpu-b", given), ("cpu", refused)):
        assert opened[task] == "".join(f"{path} {said}\n" for path in FAKE_GPUS), opened


def test_a_trial_the_jobs_memory_cgroup_kills_is_named_not_scored(
    debian_sif: Path, tmp_path: Path
) -> None:
    """Slurm holds each job to its --mem (ConstrainRAMSpace). A job given less than its trials'
    memory_mb (the user's --mem) runs out before the watchdog's threshold: the kernel kills the
    task's biggest process, and the trial fails `memory`, naming the job's cgroup, never a 0
    that reads as the agent's. The element lives on: its other trial scores."""
    tasks = tmp_path / "tasks"
    make_task(tasks, "hog", kind="memory_hog", memory_mb=4096, image=str(debian_sif))
    make_task(tasks, "fine", memory_mb=4096, image=str(debian_sif))
    run_dir = tmp_path / "run"
    waited = cli(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir), "--executor",
        "slurm", "--tasks-per-job", "2", "--concurrency", "1", "--mem", "1500", "--wait",
        check=False,
    )  # fmt: skip
    assert waited.returncode == 1, waited.stderr
    statuses = by_task(cli_json("status", str(run_dir)))
    assert (statuses["fine"]["state"], statuses["fine"]["reward"]) == ("done", 1.0)
    hog = statuses["hog"]
    assert (hog["state"], hog["failure"], hog["trainable"]) == ("failed", "memory", False), hog
    assert "OOM killer" in hog["message"] and "held to 1500 MB" in hog["message"], hog
    # submit said so before queueing: the element asks less than its trials need.
    assert "an element asks for 1500 MB, less than" in waited.stderr, waited.stderr


def test_a_trainers_batch_on_slurm_from_python(debian_sif: Path, tmp_path: Path) -> None:
    """The trainer's path on Slurm: one `run_rollouts` call queues the batch's arrays with the
    element memory, CPUs and sbatch options it was given, reports progress, waits, and returns
    one trainable line per attempt; a wrong setting is raised before anything is queued."""
    tasks = tmp_path / "tasks"
    for name in ("one", "two"):
        make_task(tasks, name, image=str(debian_sif), agent_timeout_sec=30)
    run_dir = tmp_path / "run"
    with pytest.raises(InputError, match="mem_mb must be a whole number of at least 1, not 0"):
        RolloutRequest(tasks=tasks, run_dir=run_dir, agent="oracle", executor="slurm", mem_mb=0)
    request = RolloutRequest(
        tasks=tasks, run_dir=run_dir, agent="oracle", executor="slurm", attempts=2,
        concurrency=2, mem_mb=1900, cpus=1, sbatch_args=["--comment=trainer-step-7"],
    )  # fmt: skip
    seen: list[Progress] = []
    lines = run_rollouts(request, progress=seen.append)
    assert sorted((line["task"], line["reward"], line["trainable"]) for line in lines) == [
        ("one", 1.0, True),
        ("one", 1.0, True),
        ("two", 1.0, True),
        ("two", 1.0, True),
    ]
    assert (seen[-1].done, seen[-1].total) == (4, 4)
    scripts = [path.read_text() for path in RunPaths(run_dir).submitit.rglob("*_submission.sh")]
    asked = {
        line for script in scripts for line in script.splitlines() if line.startswith("#SBATCH")
    }
    assert {
        "#SBATCH --mem=1900M",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --comment=trainer-step-7",
    } <= asked
    assert load_run(run_dir).options["mem_mb"] == 1900
