"""The model server's key (`agent_env`) reaches terminus-2's model calls, here, and nothing of
the container's: a policy that prints every variable it can see in the container (its shell's,
the container's init's) sends back no key in its next prompt, and no trial file nor exported
line holds it. The scripted server takes only that key: every reply served says litellm had it.
Through `run_rollouts` (local processes; on Ray: tests/ray/test_rollouts.py) and through `submit`
on Slurm; the key given from the trainer's environment, and as `--agent-env NAME=VALUE`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.api import RolloutRequest, run_rollouts
from harbor_hpc.results.export import ExportFormat
from tests.e2e.test_terminus2 import agent_args, solving
from tests.support.cli import cli, cli_json
from tests.support.sample_tasks import make_task
from tests.support.scripted_llm import ScriptedLLM

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]

SECRET = "sk-hh-9f3c1e7a5b2d"
# Everything the policy could read of the key, then the answer; `seen-$((6*7))` says its output
# came back (the command itself holds no `seen-42`).
PRINTS_ITS_VARIABLES = (
    "echo \"key=$OPENAI_API_KEY\"; cat /proc/1/environ | tr '\\0' '\\n'; env; "
    "echo seen-$((6*7)); echo 42 > /tmp/answer\n"
)


@contextlib.contextmanager
def policy_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedLLM]:
    """The scripted policy that prints its variables, taking only SECRET as its key."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with ScriptedLLM(solving(PRINTS_ITS_VARIABLES), api_key=SECRET) as server:
        yield server


@pytest.fixture
def llm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ScriptedLLM]:
    with policy_server(monkeypatch) as server:
        yield server


def texts(value: Any) -> Iterator[str]:
    """Every string in `value`, and every list of token ids decoded (the scripted server's
    tokens are UTF-8 bytes)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from texts(item)
    elif isinstance(value, list):
        if value and all(isinstance(item, int) and 0 <= item < 256 for item in value):
            yield bytes(value).decode(errors="replace")
        else:
            for item in value:
                yield from texts(item)


def assert_the_key_stayed_out(llm: ScriptedLLM, run_dir: Path, tmp_path: Path) -> None:
    sent = llm.exchanges
    assert [e.reply for e in sent] == llm.replies  # every call had the key
    later = json.dumps([e.request["messages"] for e in sent[1:]])
    assert "seen-42" in later and "PATH=/" in later  # the policy saw its variables
    assert SECRET not in json.dumps([e.request for e in sent])
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert files
    # Not there to be redacted: `[REDACTED]` would say it went where it was hidden after.
    assert [path for path in files if SECRET.encode() in path.read_bytes()] == []
    assert [path for path in files if b"[REDACTED]" in path.read_bytes()] == []
    for fmt in ExportFormat:
        out = tmp_path / f"{fmt}.jsonl"
        cli("export", str(run_dir), "--out", str(out), "--format", fmt.value)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(lines) == 1, fmt
        assert not any(SECRET in text for text in texts(lines)), fmt


def rollouts_with_the_key(llm: ScriptedLLM, image: Path, tmp_path: Path, **request: Any) -> None:
    """One terminus-2 rollout of the sample task through `run_rollouts`, its key OPENAI_API_KEY
    in this process's environment (the trainer's, set by the caller), `request` the
    RolloutRequest's other fields; then none of the key anywhere."""
    make_task(tmp_path / "tasks", "answer", image=str(image))
    run_dir = tmp_path / "run"
    (line,) = run_rollouts(
        RolloutRequest(
            tasks=tmp_path / "tasks",
            run_dir=run_dir,
            agent="terminus-2",
            model=f"openai/{llm.model}",
            agent_kwargs={"api_base": llm.url, "record_terminal_session": False},
            agent_env=["OPENAI_API_KEY"],
            **request,
        )
    )
    assert (line["reward"], line["trainable"]) == (1.0, True), line
    assert not any(SECRET in text for text in texts(line))
    assert_the_key_stayed_out(llm, run_dir, tmp_path)


def test_the_key_reaches_the_model_calls_and_not_the_container_through_run_rollouts(
    debian_sif: Path, llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)  # the trainer's
    rollouts_with_the_key(llm, debian_sif, tmp_path)


@pytest.mark.slurm
def test_the_key_reaches_the_model_calls_and_not_the_container_through_submit_on_slurm(
    debian_sif: Path, llm: ScriptedLLM, tmp_path: Path
) -> None:
    make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    run_dir = tmp_path / "run"
    submitted = cli(
        "submit", str(tmp_path / "tasks"), *agent_args(llm), "--run-dir", str(run_dir),
        "--executor", "slurm", "--agent-env", f"OPENAI_API_KEY={SECRET}", "--wait", "--json",
    )  # fmt: skip
    assert SECRET not in submitted.stdout + submitted.stderr
    (status,) = cli_json("status", str(run_dir))
    assert (status["state"], status["reward"]) == ("done", 1.0), status
    assert_the_key_stayed_out(llm, run_dir, tmp_path)
