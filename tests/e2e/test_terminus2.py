"""Harbor's terminus-2 agent, in harbor-hpc's environment, against a scripted model server.

terminus-2 runs on the host (litellm calls the model, tmux runs inside the container), so a
trial on this node reaches the server on loopback; under Slurm the job inherits the submitting
environment, OPENAI_API_KEY included. The script solves the sample task (42 into /tmp/answer)
and confirms completion. With `collect_rollout_details=true` Harbor records, per model call,
the token ids and logprobs the server sent: `agent_result.rollout_details` in result.json and
`steps[].metrics` in agent/trajectory.json. Both must equal what the server recorded, and so
must `export`'s, in each format, read as its trainer reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from harbor_hpc.containers.limits import ONE_ID
from harbor_hpc.containers.probes import missing_subid_ranges
from harbor_hpc.results.rollout import SCHEMA_FILE
from tests.support.cli import cli, cli_json
from tests.support.sample_tasks import FETCH_ANSWER, answer_service, make_task
from tests.support.scripted_llm import Exchange, ScriptedLLM
from tests.support.trainers import (
    nemo_rl_message_log,
    prime_rl_training_samples,
    skyrl_generator_output,
    slime_samples,
)

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


def solving(command: str) -> list[dict[str, Any]]:
    """Run `command`, then finish: terminus-2 asks to confirm the first task_complete."""
    return [turn([command], done=False), turn(["ls /tmp\n"], done=True), turn([], done=True)]


SCRIPT = solving("echo 42 > /tmp/answer\n")


@pytest.fixture
def llm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What litellm needs in the environment of every child process."""
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")  # litellm wants one; unchecked
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch from the internet


@pytest.fixture
def llms(llm_env: None) -> Iterator[tuple[ScriptedLLM, ScriptedLLM]]:
    """Two scripted servers: one per trial, each serves its script in order."""
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


def export(run_dir: Path, fmt: str, tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / f"{fmt}.jsonl"
    cli("export", str(run_dir), "--out", str(out), "--format", fmt)
    lines = [json.loads(text) for text in out.read_text().splitlines()]
    if fmt == "full":
        schema = json.loads(SCHEMA_FILE.read_text())
        for line in lines:
            jsonschema.validate(line, schema, cls=jsonschema.Draft202012Validator)
    return lines


def assert_turns_are_the_servers(line: dict[str, Any], sent: list[Exchange]) -> None:
    turns = line["turns"]
    assert [t["prompt_token_ids"] for t in turns] == [e.prompt_token_ids for e in sent]
    assert [t["completion_token_ids"] for t in turns] == [e.completion_token_ids for e in sent]
    assert [t["logprobs"] for t in turns] == [e.logprobs for e in sent]
    # The policy's tokens, and only those, are masked in: in the order the server sent them.
    trained = [t for t, m in zip(line["token_ids"], line["mask_ids"], strict=True) if m]
    assert trained == [token for e in sent for token in e.completion_token_ids]
    assert [lp for lp, m in zip(line["logprobs"], line["mask_ids"], strict=True) if m] == [
        lp for e in sent for lp in e.logprobs
    ]


@pytest.mark.slurm
def test_terminus2_gets_reward_one_by_harbor_trial_and_through_submit_on_slurm(
    debian_sif: Path,
    llms: tuple[ScriptedLLM, ScriptedLLM],
    tmp_path: Path,
) -> None:
    """The same task twice at once: `harbor trial start` on this node from the .sif, and
    `harbor-hpc submit` on Slurm over the image unpacked on the node (`unpacked_roots`; most of
    either is waiting: on Slurm, on the model, on tmux); then the Slurm run exported in every
    format."""
    direct_llm, slurm_llm = llms
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    trials = tmp_path / "trials"
    harbor = Path(sys.executable).parent / "harbor"
    command = [str(harbor), "trial", "start", "-p", str(task), *agent_args(direct_llm),
               "-e", ENVIRONMENT, "--trials-dir", str(trials)]  # fmt: skip
    direct = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run_dir, scratch = tmp_path / "run", tmp_path / "scratch"
        submitted = cli_json(
            "submit", str(task.parent), *agent_args(slurm_llm), "--run-dir", str(run_dir),
            "--executor", "slurm", "--wait", "--environment-kwarg", "unpacked_roots=2",
            "--environment-kwarg", f"scratch_dir={scratch}",
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
    roots = scratch / f"harbor-hpc-roots-{os.getuid()}"
    # Unpacked where the user's subuid range lets the unpack keep the image's owners.
    unpacked = roots.is_dir() and any(path.is_dir() for path in roots.iterdir())
    assert unpacked == (not missing_subid_ranges())
    assert ONE_ID not in status["limits"] or missing_subid_ranges()  # nothing less than Docker

    sent = slurm_llm.exchanges
    (line,) = export(run_dir, "full", tmp_path)
    assert (line["trial"], line["counts"], line["trainable"], line["reward"]) == (
        status["trial"], True, True, 1.0,
    )  # fmt: skip
    assert line["trial_dir"] == str((run_dir / "trials" / status["trial"]).resolve())
    assert_turns_are_the_servers(line, sent)
    # Each prompt extends the one before and its completion: one sequence, every token once.
    assert [t["contiguous"] for t in line["turns"]] == [True] * len(sent)
    assert line["sequence_starts"] == [0]
    assert line["token_ids"] == sent[-1].prompt_token_ids + sent[-1].completion_token_ids
    first = line["turns"][0]["messages"]
    assert first[0]["role"] == "user" and "Write 42 into /tmp/answer." in first[0]["content"]
    assert first[1]["role"] == "assistant" and first[1]["tool_calls"][0]["arguments"] == {
        "keystrokes": "echo 42 > /tmp/answer\n", "duration": 0.5,
    }  # fmt: skip

    (rl,) = export(run_dir, "harbor-rl", tmp_path)
    assert (rl["token_ids"], rl["mask_ids"]) == (line["token_ids"], line["mask_ids"])
    skyrl = skyrl_generator_output([rl])
    assert skyrl["prompt_token_ids"] == [sent[0].prompt_token_ids] and skyrl["rewards"] == [1.0]
    (prime,) = prime_rl_training_samples([rl])
    assert prime["token_ids"] == line["token_ids"] and prime["advantages"] == [0.0] * len(
        line["token_ids"]
    )  # a group of one: no advantage
    (slime,) = slime_samples([rl])
    assert slime["tokens"] == line["token_ids"] and slime["status"] == "completed"
    assert slime["tokens"][-len(sent[-1].completion_token_ids) :] == sent[-1].completion_token_ids

    (gym,) = export(run_dir, "nemo-gym", tmp_path)
    log = nemo_rl_message_log(gym)
    assert [m["token_ids"] for m in log[1::2]] == [e.completion_token_ids for e in sent]
    assert [token for m in log for token in m["token_ids"]] == line["token_ids"]
    assert gym["reward"] == 1.0 and gym["instance_id"] == "answer"


def make_two_step_task(root: Path, image: Path) -> Path:
    """Two steps in one container: 42 into /tmp/answer, then 43 into /tmp/second, each step
    verified by its own tests/test.sh."""
    task = root / "two-steps"
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text("FROM local/debian:bookworm\n")
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n\n[agent]\ntimeout_sec = 60\n\n[verifier]\ntimeout_sec = 60\n\n'
        f'[environment]\ndocker_image = "{image}"\nmemory_mb = 512\ncpus = 1\n\n'
        '[[steps]]\nname = "one"\n\n[[steps]]\nname = "two"\n'
    )
    for step, path, value in (("one", "/tmp/answer", 42), ("two", "/tmp/second", 43)):
        folder = task / "steps" / step
        (folder / "tests").mkdir(parents=True)
        (folder / "instruction.md").write_text(f"Write {value} into {path}.\n")
        test = folder / "tests" / "test.sh"
        test.write_text(
            "#!/bin/bash\nmkdir -p /logs/verifier\n"
            f'if [ "$(cat {path})" = "{value}" ]; then echo 1; else echo 0; fi'
            " > /logs/verifier/reward.txt\n"
        )
        test.chmod(0o755)
    return task


@pytest.mark.slurm
def test_a_drifting_template_and_a_multi_step_task_export_honestly(
    debian_sif: Path, llm_env: None, tmp_path: Path
) -> None:
    """A template that re-renders earlier replies (`contiguous: false` from the second turn of
    each step on), per-step rewards (step two writes 44: reward 0), and a task whose image is
    missing (an image failure: not trainable), in one run on Slurm."""
    tasks = tmp_path / "tasks"
    make_two_step_task(tasks, debian_sif)
    make_task(tasks, "noimage", image=str(tmp_path / "missing.sif"))
    script = solving("echo 42 > /tmp/answer\n") + solving("echo 44 > /tmp/second\n")
    with ScriptedLLM(script, rewrite_history=True) as llm:
        run_dir = tmp_path / "run"
        submit = ["submit", str(tasks), *agent_args(llm), "--run-dir", str(run_dir)]
        waited = cli(*submit, "--executor", "slurm", "--wait", "--json", check=False)
    assert list(json.loads(waited.stdout)["image_problems"]) == ["noimage"], waited.stderr
    assert waited.returncode == 1, waited.stderr  # an attempt failed: noimage's
    sent = llm.exchanges
    assert [e.reply for e in sent] == llm.replies

    lines = {line["task"]: line for line in export(run_dir, "full", tmp_path)}
    steps = lines["two-steps"]
    assert (steps["reward"], steps["trainable"], steps["failure"]) == (0.5, True, None)
    assert [(s["name"], s["reward"]) for s in steps["steps"]] == [("one", 1.0), ("two", 0.0)]
    assert [s["instruction"] for s in steps["steps"]] == [
        "Write 42 into /tmp/answer.\n", "Write 43 into /tmp/second.\n",
    ]  # fmt: skip
    assert [t["step"] for t in steps["turns"]] == ["one"] * 3 + ["two"] * 3
    assert_turns_are_the_servers(steps, sent)
    assert [t["contiguous"] for t in steps["turns"]] == [True, False, False] * 2
    # Every turn starts a sequence of its own: its whole prompt, then its completion.
    starts = steps["sequence_starts"]
    assert len(starts) == 6
    for start, end, exchange in zip(starts, [*starts[1:], None], sent, strict=True):
        whole = exchange.prompt_token_ids + exchange.completion_token_ids
        assert steps["token_ids"][start:end] == whole

    noimage = lines["noimage"]
    assert (noimage["failure"], noimage["trainable"], noimage["trial"]) == ("image", False, None)

    rl = export(run_dir, "harbor-rl", tmp_path)
    assert [(r["task"], r["sequence"], r["sequences"]) for r in rl] == [
        ("two-steps", i, 6) for i in range(6)
    ]
    assert skyrl_generator_output(rl)["response_ids"] == [e.completion_token_ids for e in sent]
    gym = export(run_dir, "nemo-gym", tmp_path)
    assert [nemo_rl_message_log(g)[1]["token_ids"] for g in gym] == [
        e.completion_token_ids for e in sent
    ]
    # A trainer is told where the container was weaker than Docker's (CI's user without a
    # subuid range: one id), in every line of both formats.
    (named,) = {tuple(r["environment_limits"]) for r in rl} | {
        tuple(g["metadata"]["environment_limits"]) for g in gym
    }
    assert (ONE_ID in named) == bool(missing_subid_ranges()), named


def test_the_trainer_example_gets_the_servers_tokens_back_in_python(
    debian_sif: Path, tmp_path: Path
) -> None:
    """examples/rollouts.py, as a trainer would run it: harbor_hpc.api in its own process,
    the trials as local processes (no Slurm), each rollout's policy tokens those the server
    sent."""
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    example = Path(__file__).resolve().parents[2] / "examples" / "rollouts.py"
    with ScriptedLLM(SCRIPT) as llm:
        ran = subprocess.run(
            [sys.executable, str(example), str(task.parent), str(tmp_path / "run"),
             "--api-base", llm.url, "--model", f"openai/{llm.model}"],
            env={**os.environ, "OPENAI_API_KEY": "scripted-test-key"},
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        sent = llm.exchanges
    assert ran.returncode == 0, ran.stderr
    produced = sum(len(e.completion_token_ids) for e in sent)
    total = len(sent[-1].prompt_token_ids) + len(sent[-1].completion_token_ids)
    assert ran.stdout.splitlines() == [
        f"answer #0: reward=1.0 trainable=True policy_tokens={produced}/{total}",
        "group answer: 1 rollouts, used",
    ]
    assert "[rollouts] 1 done, 0 failed, 0 running, 0 pending of 1" in ran.stderr


@pytest.mark.slurm
def test_terminus2_solves_a_compose_task_through_submit_on_slurm(
    debian_sif: Path, llm_env: None, tmp_path: Path
) -> None:
    """A task whose answer only a compose service beside it knows (reached by its name once
    healthy): terminus-2 fetches it through tmux, on Slurm, and its tokens come back exactly."""
    task = make_task(
        tmp_path / "tasks", "pod", kind="from_service", image=str(debian_sif),
        compose=answer_service(str(debian_sif)),
    )  # fmt: skip
    with ScriptedLLM(solving(FETCH_ANSWER)) as llm:
        run_dir = tmp_path / "run"
        cli_json(
            "submit", str(task.parent), *agent_args(llm), "--run-dir", str(run_dir),
            "--executor", "slurm", "--wait",
        )  # fmt: skip
        (status,) = cli_json("status", str(run_dir))
        assert (status["state"], status["reward"], status["failure"]) == ("done", 1.0, None), status
        assert_solved_with_the_servers_tokens(run_dir / "trials" / status["trial"], llm)
        (line,) = export(run_dir, "full", tmp_path)
        assert_turns_are_the_servers(line, llm.exchanges)


def test_a_model_server_that_fails_the_agent_gives_no_trainable_zero(
    debian_sif: Path, llm_env: None, tmp_path: Path
) -> None:
    """A model the server does not serve, past the check before the batch (as a server that
    changes during a run would be): the trial is the model server's failure, its reward none to
    learn from, as Harbor's error policy says; never the agent's zero."""
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    run_dir = tmp_path / "run"
    with ScriptedLLM(SCRIPT) as llm:
        args = agent_args(llm)
        args[args.index(f"openai/{llm.model}")] = "openai/not-served"
        refused = cli(
            "submit", str(task.parent), *args, "--run-dir", str(run_dir), "--executor", "local",
            check=False,
        )  # fmt: skip
        assert refused.returncode == 2 and "does not serve 'not-served'" in refused.stderr
        assert not (run_dir / "run.json").exists()
        cli(
            "submit", str(task.parent), *args, "--run-dir", str(run_dir), "--executor", "local",
            "--no-model-check", "--wait", check=False,
        )  # fmt: skip
    (status,) = cli_json("status", str(run_dir))
    assert (status["state"], status["failure"]) == ("failed", "model"), status
    (line,) = export(run_dir, "full", tmp_path)
    assert line["trainable"] is False
    assert export(run_dir, "harbor-rl", tmp_path) == []
