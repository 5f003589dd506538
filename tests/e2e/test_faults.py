"""Rewards a trainer can trust under faults: terminus-2 against a model server made to misbehave,
one batch, every case at once, each asserting what the trainer's formats carry.

The rule (docs/results.md): a rollout is trainable only when the policy alone made its outcome.
A server that hangs, answers late, answers errors, closes the connection, sends what is not JSON
or drops the token ids is the server's (`model`, not trainable), whatever the reward the
verifier then gave (the first reply may have solved the task). The context window and the turn
limit are the policy's (trainable, their reward stands). An image without what the agent runs
is refused before any trial starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.api import (
    HarborHpcError,
    Progress,
    RolloutRequest,
    cancel_run,
    run_rollouts,
    run_status,
)
from harbor_hpc.results.record import update_run
from tests.e2e.test_terminus2 import SCRIPT, agent_args, export, turn
from tests.support.cli import cli, cli_json
from tests.support.sample_tasks import make_task
from tests.support.scripted_llm import Fault, ScriptedLLM

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]

# Seconds the agent gets where a server that hangs must be caught by its time running out:
# long enough for its first command to run on a loaded machine (CI's, a dozen trials in one
# process on two busy cores, once took over 40 s to read the first answer).
SHORT = 90
# Where the agent's own retries must give up first (litellm's and terminus-2's: a minute or two).
LONG = 400

# The fault, the agent's time, and what the attempt must come to: state, failure, trainable,
# reward (None: whatever the verifier gave).
CASES: dict[str, tuple[Fault | None, float, tuple[str, str | None, bool, float | None]]] = {
    "clean": (None, LONG, ("done", None, True, 1.0)),
    "hang-start": (Fault(hang=True), SHORT, ("failed", "model", False, 0.0)),
    # The first reply solves the task; the second never comes: reward 1, not the policy's.
    "hang-mid": (Fault(after=1, hang=True), SHORT, ("failed", "model", False, 1.0)),
    "slower-than-the-agent": (Fault(after=1, delay_s=240), SHORT, ("failed", "model", False, 1.0)),
    "http-500": (Fault(status=500), LONG, ("failed", "model", False, None)),
    # Errors after the solving reply, retried until the agent's time runs out: between two
    # retries or in one, the server's.
    "http-500-till-the-time-runs-out": (
        Fault(after=1, status=500),
        SHORT,
        ("failed", "model", False, 1.0),
    ),
    "http-429": (Fault(status=429), LONG, ("failed", "model", False, None)),
    "closes-mid-answer": (Fault(close=True), LONG, ("failed", "model", False, None)),
    "not-json": (Fault(malformed=True), LONG, ("failed", "model", False, None)),
    "drops-tokens": (Fault(after=1, no_tokens=True), LONG, ("failed", "model", False, 1.0)),
    # The policy's own: its context ran out after the reply that solved the task.
    "context-window": (Fault(after=1, context_exceeded=True), LONG, ("failed", "agent", True, 1.0)),
    # The policy's own: it never finishes, and the turn limit ends it unsolved.
    "turn-limit": (Fault(reply=turn(["ls /\n"], done=False)), LONG, ("done", None, True, 0.0)),
}


def test_every_fault_of_the_server_is_named_and_never_trainable(
    debian_sif: Path, tiny_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    tasks = tmp_path / "tasks"
    for name, (_, timeout, _) in CASES.items():
        task = make_task(tasks, name, image=str(debian_sif), agent_timeout_sec=timeout)
        (task / "instruction.md").write_text(f"Write 42 into /tmp/answer. [fault:{name}]\n")
    # terminus-2 in an image without bash and tmux: refused before anything runs, by name.
    make_task(tasks, "no-tmux", image=str(tiny_sif))
    faults = {name: fault for name, (fault, _, _) in CASES.items() if fault is not None}
    run_dir = tmp_path / "run"
    with ScriptedLLM(SCRIPT, each_conversation=True, faults=faults) as llm:
        args = agent_args(llm)
        submitted = cli(
            "submit", str(tasks), *args, "--agent-kwarg", "max_turns=3",
            "--agent-kwarg", "enable_summarize=false", "--run-dir", str(run_dir),
            "--executor", "local", "--concurrency", str(len(CASES)), "--wait",
            check=False,
        )  # fmt: skip
    assert "no-tmux" in submitted.stderr and "has no bash or tmux" in submitted.stderr, (
        submitted.stderr
    )
    statuses = {s["task"]: s for s in cli_json("status", str(run_dir))}
    got = {
        task: (s["state"], s["failure"], s["trainable"], s["reward"])
        for task, s in statuses.items()
    }
    wanted: dict[str, Any] = {}
    for name, (_, _, (state, failure, trainable, reward)) in CASES.items():
        wanted[name] = (state, failure, trainable, got[name][3] if reward is None else reward)
    wanted["no-tmux"] = ("failed", "image", False, None)
    assert got == wanted, json.dumps(statuses, indent=1)
    assert "waited" in statuses["hang-mid"]["message"]
    assert "no token ids" in statuses["drops-tokens"]["message"]

    full = {line["task"]: line for line in export(run_dir, "full", tmp_path)}
    for task, status in statuses.items():
        line = full[task]
        assert (line["failure"], line["trainable"]) == (status["failure"], status["trainable"])
        # Every group has one attempt here: whole and valid exactly when its line is.
        assert (line["group"], line["group_size"]) == (task, 1)
        assert line["group_trainable"] is line["trainable"]
        if line["trainable"]:
            assert line["reward"] is not None and line["token_ids"], task
    # The trainer's formats hold the policy's rollouts and nothing else.
    rl = export(run_dir, "harbor-rl", tmp_path)
    assert sorted(line["task"] for line in rl) == ["clean", "context-window", "turn-limit"]
    assert all(line["group_trainable"] is True for line in rl)
    gym = export(run_dir, "nemo-gym", tmp_path)
    assert sorted(line["instance_id"] for line in gym) == sorted(line["task"] for line in rl)


def test_ctrl_c_stops_the_waiting_in_one_line_and_the_local_trial_runs_on(
    debian_sif: Path, tmp_path: Path
) -> None:
    """The terminal's Ctrl-C reaches its whole foreground process group: the local jobs'
    controllers printed KeyboardInterrupt tracebacks there and their trials broke. Now they
    ignore it, as Slurm's jobs never see it, and only the waiting stops."""
    make_task(tmp_path / "tasks", "pausing", kind="pausing", image=str(debian_sif))
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "harbor_hpc", "submit", str(tmp_path / "tasks"),
               "--agent", "oracle", "--run-dir", str(run_dir), "--executor", "local",
               "--wait"]  # fmt: skip
    # Started as a terminal's shell starts a command, Ctrl-C at its default: started from a
    # background job (a CI run's `bash .ci/run &`), it would inherit SIGINT ignored, and Python
    # then never raises KeyboardInterrupt.
    waiting = subprocess.Popen(
        command,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not list((run_dir / "markers").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert waiting.poll() is None, "the waiting ended before its trial had started"
        os.killpg(waiting.pid, signal.SIGINT)  # as the terminal sends Ctrl-C
        out, err = waiting.communicate(timeout=60)
    finally:
        waiting.kill()
    assert waiting.returncode == 130, err
    assert "interrupted: the waiting stopped, the run goes on" in err
    assert "Traceback" not in out + err
    (status,) = cli_json("status", str(run_dir))
    deadline = time.monotonic() + 180
    while status["state"] in ("pending", "running") and time.monotonic() < deadline:
        time.sleep(1)
        (status,) = cli_json("status", str(run_dir))
    assert (status["state"], status["reward"], status["trainable"]) == ("done", 1.0, True), status
    logs = " ".join(path.read_text() for path in (run_dir / "submitit").rglob("*.err"))
    assert "KeyboardInterrupt" not in logs


@pytest.mark.slurm
def test_a_job_slurm_will_never_start_ends_the_wait_at_once_with_slurms_reason(
    debian_sif: Path, tmp_path: Path
) -> None:
    """Five nodes of a one-node partition: Slurm takes the job and keeps it pending for good
    (PartitionNodeLimit). `submit --wait` and `run_rollouts` waited for it without end."""
    make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    started = time.monotonic()
    waited = cli(
        "submit", str(tmp_path / "tasks"), "--agent", "oracle", "--run-dir", str(tmp_path / "run"),
        "--executor", "slurm", "--sbatch-arg=--nodes=5", "--wait", check=False,
    )  # fmt: skip
    assert waited.returncode == 1, waited.stderr
    assert "Slurm will never start job(s)" in waited.stderr
    # Slurm 22.05 says PartitionConfig or PartitionNodeLimit, as it first weighs the job.
    assert re.search(r"\(Partition\w+: they ask for more than the partition", waited.stderr)
    assert time.monotonic() - started < 90
    (status,) = cli_json("status", str(tmp_path / "run"))
    assert (status["state"], status["failure"]) == ("failed", "infrastructure")

    request = RolloutRequest(
        tasks=tmp_path / "tasks", run_dir=tmp_path / "python", agent="oracle",
        executor="slurm", sbatch_args=["--nodes=5"],
    )  # fmt: skip
    with pytest.raises(HarborHpcError, match=r"never start job\(s\) .*\(Partition\w+: ") as err:
        run_rollouts(request)
    assert "resubmit_run" in (err.value.hint or "")  # in Python's words
    assert time.monotonic() - started < 180


@pytest.mark.slurm
def test_status_says_why_an_attempt_waits_once_it_has_waited_a_minute(
    debian_sif: Path, tmp_path: Path
) -> None:
    make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    run_dir = tmp_path / "run"
    cli(
        "submit", str(tmp_path / "tasks"), "--agent", "oracle", "--run-dir", str(run_dir),
        "--executor", "slurm", "--sbatch-arg=--begin=now+3600",
    )  # fmt: skip
    try:
        (fresh,) = cli_json("status", str(run_dir))
        assert (fresh["state"], fresh["message"]) == ("pending", None)  # not a minute yet
        with update_run(run_dir) as record:  # as if submitted two minutes ago
            record.submissions[0].submitted_at = (
                datetime.now(UTC) - timedelta(minutes=2)
            ).isoformat()
        (waiting,) = cli_json("status", str(run_dir))
        # BeginTime; Resources or Priority while other jobs hold the node: Slurm's words.
        why = waiting["message"]
        assert waiting["state"] == "pending" and re.fullmatch(r"Slurm: [A-Za-z]+", why), why
        shown = " ".join(cli("status", str(run_dir)).stdout.split())
        assert f"waiting: {why} (1)" in shown
        assert Progress.of(run_status(run_dir)).waiting == f"{why} (1)"
    finally:
        cancel_run(run_dir)


def test_a_server_that_refuses_every_connection_is_named_and_never_trainable(
    debian_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy server that went down before the batch (nothing listens at api_base; the check
    before the batch skipped): every call is refused, the trial is the server's."""
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    # Whether litellm's retries give up first or the agent's time runs out in them: the server's.
    make_task(tmp_path / "tasks", "answer", image=str(debian_sif), agent_timeout_sec=SHORT)
    with ScriptedLLM(SCRIPT) as gone:  # a port that was a server's, now closed
        args = agent_args(gone)
    cli(
        "submit", str(tmp_path / "tasks"), *args, "--run-dir", str(tmp_path / "run"),
        "--executor", "local", "--no-model-check", "--wait", check=False,
    )  # fmt: skip
    (status,) = cli_json("status", str(tmp_path / "run"))
    assert (status["state"], status["failure"], status["trainable"]) == (
        "failed", "model", False,
    ), status  # fmt: skip
    (line,) = export(tmp_path / "run", "full", tmp_path)
    assert (line["trainable"], line["group_trainable"]) == (False, False)
