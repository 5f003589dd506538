"""What a policy does to its own sandbox is the policy's outcome, scored as Docker scores it.

terminus-2 against the scripted server, one scripted policy per task (its instruction names
it), through `submit` as a user runs it: each policy does something to its own container (kills
every process it can, runs its memory past memory_mb, exits its shell, starts 2,000 processes),
most of them after writing the answer. Under Harbor's Docker environment the kernel's OOM
killer ends the one process that overran and the verifier scores what the policy left, but
`kill -9 -1` ends Docker's container (its `sh -c "sleep infinity"` exits once its `sleep` is
killed) and the trial has no reward (docs/results.md has Docker's outcomes side by side,
bench/bench_policy_acts.py measures them). Ours keeps the container and must give the
verifier's reward, trainable, never a failure of ours (`infrastructure`, `environment`,
`memory`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_terminus2 import agent_args, export, turn
from tests.support.cli import cli, cli_json
from tests.support.processes import container_processes, gone_within
from tests.support.sample_tasks import make_task
from tests.support.scripted_llm import Fault, ScriptedLLM

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]


def acting(command: str, seconds: float) -> Fault:
    """A policy that runs `command`, waits `seconds` for it, then looks and finishes
    (terminus-2 asks to confirm)."""
    first = turn([command], done=False)
    first["commands"][0]["duration"] = seconds
    return Fault(script=[first, turn(["ls /tmp\n"], done=True), turn([], done=True)])


# act: (the policy's command, the seconds it waits for it, the task's memory_mb, the reward)
ACTS: dict[str, tuple[str, float, int, float]] = {
    # tmux and the agent's shell die with every process the policy may signal: terminus-2's
    # keys fail (`tmux send-keys` killed too: return_code=137, as under Docker) or the trial
    # ends as the shell's did, and the verifier scores the answer written before.
    "kill-all": ("echo 42 > /tmp/answer; kill -9 -1\n", 0.5, 512, 1.0),
    "exit": ("echo 42 > /tmp/answer; exit\n", 0.5, 512, 1.0),
    # Its python3 is killed as Docker's OOM killer kills it; the shell and the agent go on. The
    # policy waits for that: on a loaded node the watchdog's kill took longer than 0.5 s once,
    # and a policy that stops waiting before its command ends is scored on what it left (0).
    "hog": (
        "python3 -c 'b = [b\"x\" * (20 << 20) for _ in range(60)]'; echo 42 > /tmp/answer\n",
        10,
        256,
        1.0,
    ),
    "processes": (
        # The answer first: how far the loop got when the verifier ran is the machine's load.
        "echo 42 > /tmp/answer; for i in $(seq 2000); do sleep 600 & done > /dev/null\n",
        30,
        4096,
        1.0,
    ),
    # Its dd is killed at the task's storage_mb (STORAGE_MB), before it fills the node's disk.
    "disk": ("dd if=/dev/zero of=/tmp/big bs=1M count=3000; echo 42 > /tmp/answer\n", 5, 512, 1.0),
    # The same kill without an answer: a zero, and the policy's to learn from.
    "kill-unsolved": ("kill -9 -1\n", 0.5, 512, 0.0),
}


STORAGE_MB = 256


@pytest.mark.slurm
def test_what_a_policy_does_to_its_sandbox_is_scored_as_its_own(
    debian_sif: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    tasks = tmp_path / "tasks"
    for act, (_, _, memory_mb, _) in ACTS.items():
        task = make_task(tasks, act, image=str(debian_sif), memory_mb=memory_mb)
        (task / "instruction.md").write_text(f"Write 42 into /tmp/answer. [fault:{act}]\n")
        with (task / "task.toml").open("a") as toml:  # [environment] is its last table
            toml.write(f"storage_mb = {STORAGE_MB}\n")
    faults = {act: acting(command, seconds) for act, (command, seconds, _, _) in ACTS.items()}
    run_dir = tmp_path / "run"
    with ScriptedLLM([turn([], done=True)], faults=faults) as llm:
        cli(
            "submit", str(tasks), *agent_args(llm), "--run-dir", str(run_dir),
            "--executor", "local", "--concurrency", "3", "--wait", check=False,
        )  # fmt: skip
    statuses = {row["task"]: row for row in cli_json("status", str(run_dir))}
    assert {act: row["reward"] for act, row in statuses.items()} == {
        act: reward for act, (_, _, _, reward) in ACTS.items()
    }, statuses
    lines = {line["task"]: line for line in export(run_dir, "full", tmp_path)}
    assert {act: line["trainable"] for act, line in lines.items()} == dict.fromkeys(ACTS, True)
    # Our part of the container outlived the policy's acts: where the agent failed, tmux's
    # keys did (whether they did is a race of the agent's with the kill, as under Docker).
    for row in statuses.values():
        if row["failure"] is not None:
            assert row["failure"] == "agent", row
            assert "failed to send non-blocking keys" in row["message"], row
    hog_log = (run_dir / "trials" / statuses["hog"]["trial"] / "trial.log").read_text()
    assert "out of memory: killed process" in hog_log
    disk_log = (run_dir / "trials" / statuses["disk"]["trial"] / "trial.log").read_text()
    assert "out of disk: killed process" in disk_log and "storage_mb of 256 MB" in disk_log
    assert gone_within(30, lambda: container_processes(debian_sif)) == []
