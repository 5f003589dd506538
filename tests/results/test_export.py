"""Export: rollout records from result.json and trajectory.json files shaped as Harbor writes
them (its own models serialise them), in the full schema and as two trainers read them."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from harbor.models.agent.context import AgentContext
from harbor.models.trial.result import StepResult
from harbor.models.verifier.result import VerifierResult
from harbor.trial.errors import AgentTimeoutError

from harbor_hpc.containers.errors import (
    ContainerStartFailed,
    EnvironmentHostUnavailable,
    MemoryLimitExceededError,
)
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.results.classify import AttemptState
from harbor_hpc.results.export import ExportFormat, export_run, rollout_lines
from harbor_hpc.results.record import (
    Marker,
    RunPaths,
    RunRecord,
    create_run,
    load_run,
    write_marker,
)
from harbor_hpc.results.rollout import SCHEMA_FILE
from harbor_hpc.results.status import attempt_statuses
from tests.results.test_classify import harbor_result
from tests.support.trainers import (
    nemo_rl_message_log,
    prime_rl_training_samples,
    skyrl_generator_output,
    slime_samples,
)

Turns = list[tuple[list[int], list[int]]]  # (prompt ids, completion ids) per model call

# Three turns whose prompts each extend the one before by tool output ([6, 7], [9]).
P0, C0 = [1, 2, 3], [4, 5]
P1, C1 = [*P0, *C0, 6, 7], [8]
P2, C2 = [*P1, *C1, 9], [10, 11]
EXTENDING = [(P0, C0), (P1, C1), (P2, C2)]


def logprobs(completion: list[int]) -> list[float]:
    return [-token / 64 for token in completion]


def detail(turns: Turns) -> dict[str, Any]:
    """Harbor's RolloutDetail for one conversation."""
    return {
        "prompt_token_ids": [prompt for prompt, _ in turns],
        "completion_token_ids": [completion for _, completion in turns],
        "logprobs": [logprobs(completion) for _, completion in turns],
    }


def trajectory(turns: Turns, *, ids: bool = True) -> dict[str, Any]:
    """An ATIF trajectory as terminus-2 writes it: the first prompt, then per model call an
    agent step with its tool call, the tool's output and (`ids`) the call's token ids."""
    steps: list[dict[str, Any]] = [{"step_id": 1, "source": "user", "message": "Solve it."}]
    for index, (prompt, completion) in enumerate(turns):
        call = f"call_{index}"
        steps.append(
            {
                "step_id": index + 2,
                "source": "agent",
                "message": f"reply {index}",
                "tool_calls": [
                    {
                        "tool_call_id": call,
                        "function_name": "bash_command",
                        "arguments": {"keystrokes": "ls\n"},
                    }
                ],
                "observation": {"results": [{"source_call_id": call, "content": f"out {index}"}]},
                "metrics": {"prompt_tokens": len(prompt), "completion_tokens": len(completion)}
                | (
                    {
                        "prompt_token_ids": prompt,
                        "completion_token_ids": completion,
                        "logprobs": logprobs(completion),
                    }
                    if ids
                    else {}
                ),
            }
        )
    return {"schema_version": "ATIF-v1.6", "session_id": "s", "steps": steps}


class Run:
    """A run folder with hand-made trials."""

    def __init__(
        self,
        root: Path,
        tasks: list[str],
        *,
        agent_kwargs: dict[str, Any] | None = None,
        image_problems: dict[str, str] | None = None,
        attempts: int = 1,
    ) -> None:
        self.tasks = root / "tasks"
        for task in tasks:
            (self.tasks / task).mkdir(parents=True)
            (self.tasks / task / "instruction.md").write_text(f"<!-- canary -->\nDo {task}.\n")
        self.dir = root / "run"
        kwargs = {"collect_rollout_details": True} if agent_kwargs is None else agent_kwargs
        record = RunRecord(
            str(self.tasks),
            tasks,
            "terminus-2",
            "openai/m",
            kwargs,
            "x:Y",
            {},
            {"attempts": attempts},
        )
        record.image_problems = image_problems or {}
        create_run(self.dir, record)
        self.root = root

    def trial(
        self,
        name: str,
        task: str,
        result: dict[str, Any],
        turns: Turns | None = None,
        *,
        ids: bool = True,
        attempt: int = 0,
    ) -> None:
        """A trial of `task` that ended with `result`, its agent's trajectory from `turns`."""
        host = socket.gethostname()
        write_marker(self.dir, Marker(name, task, attempt, 1, "1_0", host, 1, f"2026-{name}"))
        folder = RunPaths(self.dir).trial(name)
        (folder / "agent").mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps(result))
        if turns is not None:
            (folder / "agent" / "trajectory.json").write_text(
                json.dumps(trajectory(turns, ids=ids))
            )

    def export(self, fmt: ExportFormat = ExportFormat.FULL) -> list[dict[str, Any]]:
        out = self.root / f"{fmt}.jsonl"
        statuses = attempt_statuses(self.dir, load_run(self.dir), set())
        written = export_run(self.dir, out, statuses, fmt=fmt)
        lines = [json.loads(text) for text in out.read_text().splitlines()]
        assert written.rollouts == len(lines)
        if fmt is ExportFormat.FULL:
            validate(lines)
        return lines


def validate(lines: list[dict[str, Any]]) -> None:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for line in lines:
        jsonschema.validate(line, schema, cls=jsonschema.Draft202012Validator)


def solved(tmp_path: Path, turns: Turns, **kwargs: Any) -> dict[str, Any]:
    context = AgentContext(rollout_details=[detail(turns)])
    return harbor_result(tmp_path, rewards={"reward": 1}, agent_result=context, **kwargs)


def test_turns_are_flattened_once_with_the_policys_tokens_masked_in(tmp_path: Path) -> None:
    run = Run(tmp_path, ["a"])
    run.trial("t1", "a", solved(tmp_path, EXTENDING), EXTENDING)
    (line,) = run.export()
    assert line["schema"] == "harbor-hpc/rollout/v5"
    assert (line["task"], line["attempt"], line["trial"], line["counts"]) == ("a", 0, "t1", True)
    assert line["trial_dir"] == str((RunPaths(run.dir).trial("t1")).resolve())
    assert (line["trainable"], line["partial"], line["reward"]) == (True, False, 1.0)
    assert line["instruction"] == "Do a.\n"  # as the agent got it: Harbor strips the canary
    assert [t["completion_token_ids"] for t in line["turns"]] == [C0, C1, C2]
    assert [t["prompt_token_ids"] for t in line["turns"]] == [P0, P1, P2]
    assert [t["contiguous"] for t in line["turns"]] == [True, True, True]
    assert line["token_ids"] == list(range(1, 12))  # every token once
    assert line["mask_ids"] == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert line["logprobs"] == [0.0] * 3 + logprobs(C0) + [0.0] * 2 + logprobs(C1) + [
        0.0
    ] + logprobs(C2)
    assert line["sequence_starts"] == [0]
    assert line["subagent_turns"] == []

    def reply(index: int) -> dict[str, Any]:
        call = {"id": f"call_{index}", "name": "bash_command", "arguments": {"keystrokes": "ls\n"}}
        return {"role": "assistant", "content": f"reply {index}", "tool_calls": [call]}

    assert line["turns"][0]["messages"] == [
        {"role": "user", "content": "Solve it."},
        reply(0),
        {"role": "tool", "tool_call_id": "call_0", "content": "out 0"},
    ]
    assert line["turns"][1]["messages"][0] == reply(1)

    (rl,) = run.export(ExportFormat.HARBOR_RL)
    assert list(rl) == [
        *("task", "attempt", "trial", "group", "group_size", "group_trainable", "sequence"),
        *("sequences", "partial", "environment_limits", "branch", "reward", "token_ids"),
        *("mask_ids", "logprobs"),
    ]
    assert (rl["group"], rl["group_size"], rl["group_trainable"]) == ("a", 1, True)
    assert rl["environment_limits"] == [] and rl["branch"] is None
    skyrl = skyrl_generator_output([rl])
    assert skyrl["prompt_token_ids"] == [P0]
    assert skyrl["response_ids"] == [line["token_ids"][3:]]
    assert skyrl["loss_masks"] == [line["mask_ids"][3:]] and skyrl["rewards"] == [1.0]
    (prime,) = prime_rl_training_samples([rl])
    assert prime["token_ids"] == line["token_ids"] and prime["env_name"] == rl["task"]
    assert prime["mask"] == [m == 1 for m in line["mask_ids"]]
    assert [lp for lp, m in zip(prime["logprobs"], prime["mask"], strict=True) if m] == [
        lp for c in (C0, C1, C2) for lp in logprobs(c)
    ]
    (slime,) = slime_samples([rl])
    assert slime["tokens"] == line["token_ids"] and slime["response_length"] == len(
        line["token_ids"]
    ) - len(P0)
    assert slime["loss_mask"] == line["mask_ids"][3:] and slime["reward"] == 1.0

    (gym,) = run.export(ExportFormat.NEMO_GYM)
    log = nemo_rl_message_log(gym)
    assert [m["token_ids"] for m in log] == [P0, C0, [6, 7], C1, [9], C2]
    assert [m["role"] for m in log] == ["user", "assistant"] * 3
    assert [m["generation_logprobs"] for m in log[1::2]] == [logprobs(c) for c in (C0, C1, C2)]
    assert gym["responses_create_params"]["input"] == [
        {"role": "user", "content": "Solve it.", "type": "message"}
    ]
    kinds = [item["type"] for item in gym["response"]["output"]]
    assert kinds == ["message", "function_call", "function_call_output"] * 3
    assert gym["reward"] == 1.0 and gym["instance_id"] == "a"


def test_a_prompt_that_rewrites_history_restarts_the_flattening(tmp_path: Path) -> None:
    drifted = [(P0, C0), ([1, 2, 3, 99, 6, 7], C1), ([1, 2, 3, 99, 6, 7, 8, 9], C2)]
    run = Run(tmp_path, ["a"])
    run.trial("t1", "a", solved(tmp_path, drifted), drifted)
    (line,) = run.export()
    assert [t["contiguous"] for t in line["turns"]] == [True, False, True]
    assert line["sequence_starts"] == [0, 5]
    assert line["token_ids"] == [*P0, *C0, 1, 2, 3, 99, 6, 7, *C1, 9, *C2]
    assert line["mask_ids"] == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1]

    rl = run.export(ExportFormat.HARBOR_RL)
    assert [(r["sequence"], r["sequences"]) for r in rl] == [(0, 2), (1, 2)]
    assert skyrl_generator_output(rl)["prompt_token_ids"] == [P0, drifted[1][0]]
    gym = run.export(ExportFormat.NEMO_GYM)
    assert [len(nemo_rl_message_log(g)) for g in gym] == [2, 4]  # each a context seen as is
    joined = {"response": {"output": [i for g in gym for i in g["response"]["output"]]}}
    with pytest.raises(AssertionError, match="Non-contiguous"):
        nemo_rl_message_log(joined)  # what one line for both would do to NeMo RL


def test_a_multi_step_task_keeps_each_steps_instruction_reward_and_turns(tmp_path: Path) -> None:
    run = Run(tmp_path, ["m"])
    for name in ("one", "two"):
        (run.tasks / "m" / "steps" / name).mkdir(parents=True)
        (run.tasks / "m" / "steps" / name / "instruction.md").write_text(f"Step {name}.\n")
    result = harbor_result(tmp_path, rewards={"reward": 0.5})
    step_turns = {"one": EXTENDING[:2], "two": [([20, 21], [22])]}
    result["step_results"] = [
        json.loads(
            StepResult(
                step_name=name,
                agent_result=AgentContext(rollout_details=[detail(turns)]),
                verifier_result=VerifierResult(rewards={"reward": reward}),
            ).model_dump_json()
        )
        for (name, turns), reward in zip(step_turns.items(), (1, 0), strict=True)
    ]
    run.trial("t1", "m", result)
    for name, turns in step_turns.items():
        folder = RunPaths(run.dir).trial("t1") / "steps" / name / "agent"
        folder.mkdir(parents=True)
        (folder / "trajectory.json").write_text(json.dumps(trajectory(turns)))
    (line,) = run.export()
    assert line["reward"] == 0.5 and line["instruction"] is None
    one, two = line["steps"]
    assert (one["name"], one["instruction"], one["reward"]) == ("one", "Step one.\n", 1.0)
    assert one["rewards"] == {"reward": 1.0}
    assert (two["name"], two["reward"], two["failure"]) == ("two", 0.0, None)
    assert two["trajectory"].endswith("t1/steps/two/agent/trajectory.json")
    assert [t["step"] for t in line["turns"]] == ["one", "one", "two"]
    assert line["turns"][2]["messages"][0] == {"role": "user", "content": "Solve it."}
    # Each step is a new agent run: a new sequence.
    assert line["sequence_starts"] == [0, 8]
    assert line["token_ids"] == [*range(1, 9), 20, 21, 22]


def test_only_the_agents_failures_are_trainable(tmp_path: Path) -> None:
    missing = {"noimage": "noimage/task.toml: docker_image /x.sif does not exist"}
    tasks = ["env", "slow", "hog", "crash", "unscored", "lost", "noimage"]
    run = Run(tmp_path, tasks, image_problems=missing)
    context = AgentContext(rollout_details=[detail(EXTENDING[:1])])
    timeout = AgentTimeoutError("Agent execution timed out")
    failed = {
        "env": harbor_result(tmp_path, exception=ContainerStartFailed("no"), agent_started=False),
        "slow": harbor_result(
            tmp_path, rewards={"reward": 0}, agent_result=context, exception=timeout
        ),
        "hog": harbor_result(tmp_path, exception=MemoryLimitExceededError("limit 256 MB")),
        "crash": harbor_result(
            tmp_path, rewards={"reward": 0}, agent_result=context, exception=RuntimeError("boom")
        ),
        # The agent failed and nothing gave a reward: no reward to learn from.
        "unscored": harbor_result(tmp_path, agent_result=context, exception=RuntimeError("boom")),
        # The Ray node of the container went away mid-trial: its turns say nothing of the policy.
        "lost": harbor_result(
            tmp_path,
            agent_result=context,
            exception=EnvironmentHostUnavailable("task lost: its Ray node 10.0.0.7 was lost"),
        ),
    }
    with_turns = ("slow", "crash", "unscored", "lost")
    for task, result in failed.items():
        run.trial(f"t-{task}", task, result, EXTENDING[:1] if task in with_turns else None)
    lines = {line["task"]: line for line in run.export()}
    got = {task: (x["failure"], x["trainable"], x["partial"]) for task, x in lines.items()}
    assert got == {
        "env": ("environment", False, False),
        "slow": ("timeout", True, True),  # its turns so far, and its reward, are kept
        "hog": ("memory", False, False),
        "crash": ("agent", True, False),
        "unscored": ("agent", False, False),
        "lost": ("infrastructure", False, False),
        "noimage": ("image", False, False),
    }
    assert (lines["noimage"]["trial"], lines["noimage"]["turns"]) == (None, [])
    assert lines["slow"]["turns"][0]["completion_token_ids"] == C0

    rl = {line["task"]: line for line in run.export(ExportFormat.HARBOR_RL)}
    assert set(rl) == {"slow", "crash"}
    assert rl["slow"]["partial"] and rl["crash"]["reward"] == 0.0  # as its verifier scored it
    statuses = attempt_statuses(run.dir, load_run(run.dir), set())
    written = export_run(run.dir, tmp_path / "x.jsonl", statuses, fmt=ExportFormat.NEMO_GYM)
    assert written.left_out == {"not_trainable": 5}


def test_a_run_that_asked_for_tokens_and_got_none_writes_nothing(tmp_path: Path) -> None:
    run = Run(tmp_path, ["a", "b"])
    run.trial("t-a", "a", solved(tmp_path, EXTENDING), EXTENDING)
    # The server sent no token ids: Harbor has no rollout_details, the trajectory has the calls.
    run.trial("t-b", "b", harbor_result(tmp_path, rewards={"reward": 1}), EXTENDING, ids=False)
    out = tmp_path / "rollouts.jsonl"
    statuses = attempt_statuses(run.dir, load_run(run.dir), set())
    with pytest.raises(
        HarborHpcError, match=r"1 trial\(s\) have model calls without them: t-b$"
    ) as refused:
        export_run(run.dir, out, statuses)
    assert refused.value.exit_code == 1 and not out.exists()


def test_a_run_without_tokens_exports_messages_but_no_trainer_format(tmp_path: Path) -> None:
    run = Run(tmp_path, ["a"], agent_kwargs={})
    run.trial("t1", "a", harbor_result(tmp_path, rewards={"reward": 1}), EXTENDING, ids=False)
    (line,) = run.export()
    assert [t["messages"][-2]["content"] for t in line["turns"]] == [
        "reply 0",
        "reply 1",
        "reply 2",
    ]
    assert line["token_ids"] is None and line["turns"][0]["contiguous"] is None
    statuses = attempt_statuses(run.dir, load_run(run.dir), set())
    with pytest.raises(HarborHpcError, match="did not collect token ids") as refused:
        export_run(run.dir, tmp_path / "x.jsonl", statuses, fmt=ExportFormat.HARBOR_RL)
    assert refused.value.exit_code == 2


def test_log_probs_that_do_not_line_up_with_turns_are_dropped(tmp_path: Path) -> None:
    # Harbor's Chat skips a turn's missing log-probs: two lists for three completions.
    skewed = detail(EXTENDING) | {"logprobs": [logprobs(C0), logprobs(C2)]}
    run = Run(tmp_path, ["a"])
    context = AgentContext(rollout_details=[skewed])
    run.trial(
        "t1", "a", harbor_result(tmp_path, rewards={"reward": 1}, agent_result=context), EXTENDING
    )
    (line,) = run.export()
    assert [t["logprobs"] for t in line["turns"]] == [None, None, None]
    assert line["token_ids"] == list(range(1, 12)) and line["logprobs"] is None
    (rl,) = run.export(ExportFormat.HARBOR_RL)
    assert rl["logprobs"] is None
    assert run.export(ExportFormat.NEMO_GYM) == []  # NeMo RL needs them: left out


def test_reruns_and_subagents_each_appear_once(tmp_path: Path) -> None:
    run = Run(tmp_path, ["a"])
    summary = detail([([50, 51], [52])])  # a summarization call: a conversation of its own
    context = AgentContext(rollout_details=[detail(EXTENDING), summary])
    result = harbor_result(tmp_path, rewards={"reward": 1}, agent_result=context)
    run.trial("t1", "a", result, EXTENDING)
    run.trial("t2", "a", result, EXTENDING)  # a rerun of the attempt: it counts
    first, rerun = run.export()
    assert (first["counts"], rerun["counts"]) == (False, True)
    assert len(first["turns"]) == 3 and first["token_ids"] == list(range(1, 12))
    assert [[t["completion_token_ids"] for t in s] for s in first["subagent_turns"]] == [[[52]]]
    statuses = attempt_statuses(run.dir, load_run(run.dir), set())
    written = export_run(run.dir, tmp_path / "x.jsonl", statuses, fmt=ExportFormat.HARBOR_RL)
    assert (written.rollouts, written.left_out) == (1, {"superseded": 1})


def test_an_unwritable_out_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    # --out naming a folder used to end in "internal error: IsADirectoryError".
    run_dir = tmp_path / "run"
    create_run(run_dir, RunRecord(str(tmp_path), [], "oracle", None, {}, "x:Y", {}, {}))
    (tmp_path / "out").mkdir()
    with pytest.raises(HarborHpcError, match=r"out: cannot write the rollouts") as refused:
        export_run(run_dir, tmp_path / "out", [])
    assert refused.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temporary file


@pytest.mark.parametrize(("group_readable", "mode"), [(False, 0o600), (True, 0o640)])
def test_the_export_is_as_private_as_the_run(
    tmp_path: Path, group_readable: bool, mode: int
) -> None:
    # Rollouts quote what the agent was given and what it earned, as the run's own files do.
    run_dir = tmp_path / "run"
    options = {"group_readable": group_readable}
    create_run(run_dir, RunRecord(str(tmp_path), [], "oracle", None, {}, "x:Y", {}, options))
    out = tmp_path / "rollouts.jsonl"
    out.write_text("an older export, world-readable\n")
    out.chmod(0o644)
    export_run(run_dir, out, [])
    assert stat.S_IMODE(out.stat().st_mode) == mode


def test_every_line_says_whether_its_group_is_whole_and_trainable(tmp_path: Path) -> None:
    """A GRPO group (the attempts of a task) is masked whole when one member is not trainable,
    which the trainer formats leave out: the members they keep say so themselves."""
    run = Run(tmp_path, ["whole", "broken", "waiting"], attempts=2)
    context = AgentContext(rollout_details=[detail(EXTENDING)])
    solved = harbor_result(tmp_path, rewards={"reward": 1}, agent_result=context)
    hog = harbor_result(tmp_path, exception=MemoryLimitExceededError("limit 256 MB"))
    for task, attempt, result in (
        ("whole", 0, solved),
        ("whole", 1, solved),
        ("broken", 0, solved),
        ("broken", 1, hog),
        ("waiting", 0, solved),
    ):
        run.trial(f"{task}-{attempt}", task, result, EXTENDING, attempt=attempt)
    statuses = attempt_statuses(run.dir, load_run(run.dir), set())
    (never,) = [s for s in statuses if s.trial is None]
    never.state = AttemptState.PENDING  # its job still queued
    lines, _ = rollout_lines(run.dir, statuses, fmt=ExportFormat.HARBOR_RL)
    verdicts = {(line["group"], line["attempt"]): line["group_trainable"] for line in lines}
    assert verdicts == {
        ("whole", 0): True,
        ("whole", 1): True,
        ("broken", 0): False,  # its other member ran out of memory: left out, and said here
        ("waiting", 0): None,  # its other member has not ended
    }
    assert all(line["group_size"] == 2 for line in lines)


def test_a_run_whose_jobs_are_being_queued_waits_it_has_not_failed(tmp_path: Path) -> None:
    """Between run.json's first write and its jobs' ids, a trainer polling `run_status` read
    every attempt `failed / infrastructure` (never submitted) for up to 200 ms."""
    run = Run(tmp_path, ["a"])
    record = load_run(run.dir)
    (alone,) = attempt_statuses(run.dir, record, set())
    assert (alone.state, alone.message) == ("failed", "never submitted")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from harbor_hpc.core.files import file_lock\n"
         "with file_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
         str(RunPaths(run.dir).submit_lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (queueing,) = attempt_statuses(run.dir, record, set())
        assert (queueing.state, queueing.failure) == ("pending", None)
    finally:
        holder.kill()
        holder.wait()
