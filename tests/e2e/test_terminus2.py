"""Harbor's terminus-2 agent, in harbor-hpc's environment, against a scripted model server.

terminus-2 runs on the host (litellm calls the model, tmux runs inside the container), so a
trial on this node reaches the server on loopback; under Slurm the job inherits the submitting
environment, OPENAI_API_KEY included. The script solves the sample task (42 into /tmp/answer)
and confirms completion. With `collect_rollout_details=true` Harbor records, per model call,
the token ids and logprobs the server sent: `agent_result.rollout_details` in result.json and
`steps[].metrics` in agent/trajectory.json. Both must equal what the server recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import cli_json
from tests.support.sample_tasks import make_task
from tests.support.scripted_llm import ScriptedLLM

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]

ENVIRONMENT = "harbor_hpc.environment:SingularityEnvironment"


def turn(keystrokes: list[str], *, done: bool) -> dict[str, Any]:
    """One reply in terminus-2's JSON format."""
    return {
        "analysis": "The answer file is the goal.",
        "plan": "Write it, check it, finish.",
        "commands": [{"keystrokes": k, "duration": 0.5} for k in keystrokes],
        "task_complete": done,
    }


# terminus-2 asks to confirm the first task_complete, hence two in a row.
SCRIPT = [
    turn(["echo 42 > /tmp/answer\n"], done=False),
    turn(["cat /tmp/answer\n"], done=True),
    turn([], done=True),
]


@pytest.fixture
def llm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedLLM]:
    """The scripted server, and what litellm needs in the environment of every child process."""
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")  # litellm wants one; unchecked
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet
    with ScriptedLLM(SCRIPT) as server:
        yield server


def agent_args(llm: ScriptedLLM) -> list[str]:
    return [
        "--agent", "terminus-2",
        "--model", f"openai/{llm.model}",
        "--agent-kwarg", f"api_base={llm.url}",
        "--agent-kwarg", "collect_rollout_details=true",
        "--agent-kwarg", "record_terminal_session=false",  # no asciinema to install
    ]  # fmt: skip


def assert_solved_with_the_servers_tokens(trial: Path, llm: ScriptedLLM) -> None:
    result = json.loads((trial / "result.json").read_text())
    assert result["exception_info"] is None, result["exception_info"]
    assert result["verifier_result"]["rewards"]["reward"] == 1.0
    sent = llm.exchanges
    assert [e.reply for e in sent] == llm.replies  # every reply used, none repeated
    assert all(e.request.get("return_token_ids") and e.request.get("logprobs") for e in sent)

    (details,) = result["agent_result"]["rollout_details"]
    assert details["prompt_token_ids"] == [e.prompt_token_ids for e in sent]
    assert details["completion_token_ids"] == [e.completion_token_ids for e in sent]
    assert details["logprobs"] == [e.logprobs for e in sent]

    trajectory = json.loads((trial / "agent" / "trajectory.json").read_text())
    metrics = [step["metrics"] for step in trajectory["steps"] if step["source"] == "agent"]
    assert [m["prompt_token_ids"] for m in metrics] == [e.prompt_token_ids for e in sent]
    assert [m["completion_token_ids"] for m in metrics] == [e.completion_token_ids for e in sent]
    assert [m["logprobs"] for m in metrics] == [e.logprobs for e in sent]


def test_harbor_trial_with_terminus2_gets_reward_one(
    debian_sif: Path,
    llm: ScriptedLLM,
    tmp_path: Path,
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    trials = tmp_path / "trials"
    harbor = Path(sys.executable).parent / "harbor"
    command = [str(harbor), "trial", "start", "-p", str(task), *agent_args(llm),
               "-e", ENVIRONMENT, "--trials-dir", str(trials)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (trial,) = trials.iterdir()
    assert_solved_with_the_servers_tokens(trial, llm)


@pytest.mark.slurm
def test_submit_terminus2_on_slurm_gets_reward_one(
    debian_sif: Path,
    llm: ScriptedLLM,
    tmp_path: Path,
) -> None:
    tasks = tmp_path / "tasks"
    make_task(tasks, "answer", image=str(debian_sif))
    run_dir = tmp_path / "run"
    submitted = cli_json(
        "submit", str(tasks), *agent_args(llm), "--run-dir", str(run_dir),
        "--executor", "slurm", "--wait",
    )  # fmt: skip
    assert submitted["trials"] == 1

    (status,) = cli_json("status", str(run_dir))
    assert (status["state"], status["reward"], status["failure"]) == ("done", 1.0, None), status
    assert_solved_with_the_servers_tokens(run_dir / "trials" / status["trial"], llm)
