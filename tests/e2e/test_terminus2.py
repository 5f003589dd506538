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
def llms(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ScriptedLLM, ScriptedLLM]]:
    """Two scripted servers (one per trial: each serves its script in order), and what litellm
    needs in the environment of every child process."""
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")  # litellm wants one; unchecked
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet
    with ScriptedLLM(SCRIPT) as direct, ScriptedLLM(SCRIPT) as through_slurm:
        yield direct, through_slurm


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


@pytest.mark.slurm
def test_terminus2_gets_reward_one_by_harbor_trial_and_through_submit_on_slurm(
    debian_sif: Path,
    llms: tuple[ScriptedLLM, ScriptedLLM],
    tmp_path: Path,
) -> None:
    """The same task twice at once: `harbor trial start` on this node, and `harbor-hpc submit`
    on Slurm (most of either is waiting: on Slurm, on the model, on tmux)."""
    direct_llm, slurm_llm = llms
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    trials = tmp_path / "trials"
    harbor = Path(sys.executable).parent / "harbor"
    command = [str(harbor), "trial", "start", "-p", str(task), *agent_args(direct_llm),
               "-e", ENVIRONMENT, "--trials-dir", str(trials)]  # fmt: skip
    direct = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run_dir = tmp_path / "run"
        submitted = cli_json(
            "submit", str(task.parent), *agent_args(slurm_llm), "--run-dir", str(run_dir),
            "--executor", "slurm", "--wait",
        )  # fmt: skip
        output, _ = direct.communicate(timeout=600)
    finally:
        direct.kill()
    assert direct.returncode == 0, output
    (trial,) = trials.iterdir()
    assert_solved_with_the_servers_tokens(trial, direct_llm)

    assert submitted["trials"] == 1
    (status,) = cli_json("status", str(run_dir))
    assert (status["state"], status["reward"], status["failure"]) == ("done", 1.0, None), status
    assert_solved_with_the_servers_tokens(run_dir / "trials" / status["trial"], slurm_llm)
