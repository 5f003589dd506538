"""One trial as a rollout record (schema `harbor-hpc/rollout/v5`, `schemas/rollout.schema.json`).

Harbor keeps the tokens of an agent's conversation in `agent_result.rollout_details`
(`harbor.models.agent.rollout_detail.RolloutDetail`): per model call (a turn) the whole prompt's
token ids, the completion's ids and their log-probs. The first detail is the main agent's
conversation, later ones its subagents' (terminus-2's summarization calls). The chat messages
of each turn come from the agent's ATIF trajectory (agent/trajectory.json). A multi-step task
(`[[steps]]` in task.toml) has all of this per step, in `step_results`, each step a new run of
the agent with its own instruction, verifier and reward.

Flattening (`token_ids`, `mask_ids`, `logprobs`) of the main conversation: the first turn's
prompt (mask 0) and completion (mask 1), then per later turn the part of its prompt that extends
the tokens so far (tool output, the template's turn markers: mask 0) and its completion (mask 1).
Log-probs are the model's on mask-1 tokens and 0.0 elsewhere. A turn whose prompt does not begin
with every token so far (the agent or the chat template rewrote the history: summarization,
reasoning stripped, re-tokenization drift) is `contiguous: false` and the flattening restarts
there: a new sequence, its offset in `sequence_starts`, begins with that turn's whole prompt. The
first turn of each step starts a sequence too (a new agent run). So every sequence is a context
the model saw, token for token.

Harbor itself flattens nothing (this version has no loss mask and no RL trainer); the reading
is NeMo RL's (its NeMo Gym bridge checks the same prefix and takes the same prompt deltas) and
SkyRL's (a prompt, then response tokens with a loss mask and 0.0 log-probs off the policy).

Only trials whose reward Harbor's error policy calls valid are `trainable` (classify.validity):
those that ended, or that the agent itself failed; a trial the cluster, the image, the task's
setup, its verifier or the model server broke says nothing about the policy. An agent that ran
out of time keeps its turns and its reward (Harbor still verifies it) and is marked `partial`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from harbor_hpc.containers.branch import read_branch
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import read_json
from harbor_hpc.results.classify import Outcome, outcome_of_result, outcome_of_trial
from harbor_hpc.results.record import RunRecord

SCHEMA = "harbor-hpc/rollout/v5"
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "schemas" / "rollout.schema.json"
# Where Harbor's agents write an ATIF trajectory, relative to the trial (or step) folder.
TRAJECTORY = Path("agent") / "trajectory.json"
TIMED_PHASES = ("environment_setup", "agent_setup", "agent_execution", "verifier")
AGENT_TIMEOUT = "AgentTimeoutError"  # harbor.trial.errors; other timeouts are not the agent's
# The fields of Harbor's AgentContext that its TrialResult sums over a trial's agent runs.
SUMMED = ("n_input_tokens", "n_cache_tokens", "n_output_tokens", "cost_usd")


@dataclass
class Turn:
    """One model call: what the agent's trajectory says was said, and the tokens."""

    step: str | None
    messages: list[dict[str, Any]] | None
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    extra: dict[str, Any] | None
    contiguous: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "messages": self.messages,
            "prompt_token_ids": self.prompt_token_ids,
            "completion_token_ids": self.completion_token_ids,
            "logprobs": self.logprobs,
            "contiguous": self.contiguous,
            "extra": self.extra,
        }


@dataclass
class Sequence:
    """A context the model saw, token for token: its turns, their tokens, the loss mask (1 where
    the model produced the token) and the log-probs (the model's where 1, else 0.0)."""

    turns: list[Turn]
    token_ids: list[int]
    mask_ids: list[int]
    logprobs: list[float] | None


@dataclass
class Conversation:
    """What an agent run (a trial, or one step) recorded."""

    turns: list[Turn]
    subagent_turns: list[list[Turn]]
    llm_turns: int  # model calls its trajectory reports output for: each should have tokens


def _seconds(timing: Any) -> float | None:
    if (
        not isinstance(timing, dict)
        or not timing.get("started_at")
        or not timing.get("finished_at")
    ):
        return None
    started = datetime.fromisoformat(timing["started_at"])
    finished = datetime.fromisoformat(timing["finished_at"])
    return (finished - started).total_seconds()


def _read_trajectory(path: Path) -> dict[str, Any]:
    try:
        trajectory = read_json(path)
    except HarborHpcError:
        return {}  # none, or an agent killed mid-write: the tokens in result.json still stand
    return trajectory if isinstance(trajectory, dict) else {}


def _assistant(step: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": step.get("message")}
    if step.get("reasoning_content"):
        message["reasoning_content"] = step["reasoning_content"]
    if step.get("tool_calls"):
        message["tool_calls"] = [
            {
                "id": call.get("tool_call_id"),
                "name": call.get("function_name"),
                "arguments": call.get("arguments"),
            }
            for call in step["tool_calls"]
        ]
    return message


def _tool_results(step: dict[str, Any]) -> list[dict[str, Any]]:
    results = (step.get("observation") or {}).get("results") or []
    return [
        {
            "role": "tool",
            "tool_call_id": result.get("source_call_id"),
            "content": result.get("content"),
        }
        for result in results
    ]


@dataclass
class _AtifTurn:
    metrics: dict[str, Any]
    messages: list[dict[str, Any]]


def _atif_turns(trajectory: dict[str, Any]) -> list[_AtifTurn]:
    """Each agent step with its messages: the user and system steps since the one before, its
    reply (and tool calls), and the tool output it got (which the next prompt carries)."""
    turns: list[_AtifTurn] = []
    pending: list[dict[str, Any]] = []
    for step in trajectory.get("steps") or []:
        if step.get("is_copied_context"):
            continue  # context a subagent was handed, recorded where it was said first
        if step.get("source") != "agent":
            pending.append({"role": step.get("source"), "content": step.get("message")})
            continue
        turns.append(
            _AtifTurn(step.get("metrics") or {}, [*pending, _assistant(step), *_tool_results(step)])
        )
        pending = []
    return turns


def _aligned(values: Any, count: int) -> list[Any]:
    """Per-turn values, or None for each turn when they cannot be told apart: Harbor's Chat skips
    a turn's empty value, so a list of another length no longer lines up with the turns."""
    return list(values) if isinstance(values, list) and len(values) == count else [None] * count


def _detail_turns(detail: dict[str, Any], step: str | None) -> list[Turn]:
    completions = detail.get("completion_token_ids") or []
    count = len(completions)
    prompts = _aligned(detail.get("prompt_token_ids"), count)
    logprobs = _aligned(detail.get("logprobs"), count)
    extra = detail.get("extra") or {}
    extras = {key: _aligned(values, count) for key, values in extra.items()}
    turns = []
    for index, completion in enumerate(completions):
        turn_logprobs = logprobs[index]
        if turn_logprobs is not None and len(turn_logprobs) != len(completion):
            turn_logprobs = None
        turn_extra = {key: values[index] for key, values in extras.items()} or None
        turns.append(Turn(step, None, prompts[index], completion, turn_logprobs, turn_extra))
    return turns


def _atif_token_turn(atif: _AtifTurn, step: str | None) -> Turn:
    completion = atif.metrics.get("completion_token_ids") or None
    logprobs = atif.metrics.get("logprobs")
    if completion is None or not isinstance(logprobs, list) or len(logprobs) != len(completion):
        logprobs = None
    prompt = atif.metrics.get("prompt_token_ids") if completion is not None else None
    return Turn(step, atif.messages, prompt, completion, logprobs, None)


def _attach_messages(turns: list[Turn], atif: list[_AtifTurn]) -> None:
    """Give each token turn its trajectory messages: the agent step with the same completion ids
    (in order), or, when the trajectory records no ids, the step at the same place."""
    if all(t.metrics.get("completion_token_ids") for t in atif):
        cursor = 0
        for turn in turns:
            ids = turn.completion_token_ids
            later = range(cursor, len(atif))
            found = next((i for i in later if atif[i].metrics["completion_token_ids"] == ids), None)
            if found is not None:
                turn.messages, cursor = atif[found].messages, found + 1
    elif len(atif) == len(turns):
        for turn, step in zip(turns, atif, strict=True):
            turn.messages = step.messages


def conversation(
    agent_result: dict[str, Any] | None, trajectory: Path, step: str | None
) -> Conversation:
    """The turns of one agent run from its `agent_result` and its ATIF trajectory file."""
    agent_result = agent_result or {}
    details = agent_result.get("rollout_details") or []
    atif = _atif_turns(_read_trajectory(trajectory))
    if details:
        turns = _detail_turns(details[0], step)
        _attach_messages(turns, atif)
    else:  # some agents record token ids only per step of their trajectory
        turns = [_atif_token_turn(t, step) for t in atif]
    subagents = [_detail_turns(detail, step) for detail in details[1:]]
    if atif:
        llm_turns = sum(1 for t in atif if (t.metrics.get("completion_tokens") or 0) > 0)
    else:  # no trajectory: one model call at least when the agent reports output tokens
        llm_turns = 1 if (agent_result.get("n_output_tokens") or 0) > 0 else 0
    return Conversation(turns, subagents, llm_turns)


def mark_contiguity(turns: list[Turn]) -> None:
    """Set each token turn's `contiguous` (None for a turn without prompt and completion ids)."""
    previous: Turn | None = None
    for turn in turns:
        if turn.prompt_token_ids is None or turn.completion_token_ids is None:
            previous = None
            continue
        if previous is None or previous.step != turn.step:
            turn.contiguous = True  # the start of a conversation extends nothing
        else:
            assert (
                previous.prompt_token_ids is not None and previous.completion_token_ids is not None
            )
            seen = previous.prompt_token_ids + previous.completion_token_ids
            turn.contiguous = turn.prompt_token_ids[: len(seen)] == seen
        previous = turn


def sequences(turns: list[Turn]) -> list[Sequence] | None:
    """`turns` (contiguity marked) flattened, or None unless every turn has prompt and
    completion ids (no turns: none either)."""
    if not turns or any(t.contiguous is None for t in turns):
        return None
    found: list[Sequence] = []
    for turn in turns:
        assert turn.prompt_token_ids is not None and turn.completion_token_ids is not None
        if not found or not turn.contiguous or turn.step != found[-1].turns[-1].step:
            found.append(Sequence([], [], [], []))
        sequence = found[-1]
        new_prompt = turn.prompt_token_ids[len(sequence.token_ids) :]
        sequence.turns.append(turn)
        sequence.token_ids += new_prompt + turn.completion_token_ids
        sequence.mask_ids += [0] * len(new_prompt) + [1] * len(turn.completion_token_ids)
        if sequence.logprobs is not None:
            sequence.logprobs = (
                None
                if turn.logprobs is None
                else sequence.logprobs + [0.0] * len(new_prompt) + turn.logprobs
            )
    return found


def _flat(found: list[Sequence] | None) -> dict[str, Any]:
    """The line's flattened fields: the sequences one after the other."""
    if found is None:
        return {"token_ids": None, "mask_ids": None, "logprobs": None, "sequence_starts": None}
    starts, offset = [], 0
    for sequence in found:
        starts.append(offset)
        offset += len(sequence.token_ids)
    logprobs = [s.logprobs for s in found]
    return {
        "token_ids": [token for s in found for token in s.token_ids],
        "mask_ids": [mask for s in found for mask in s.mask_ids],
        "logprobs": None if None in logprobs else [lp for s in found for lp in s.logprobs or []],
        "sequence_starts": starts,
    }


def _instruction(path: Path) -> str | None:
    """The instruction at `path` as the agent got it (Harbor strips the canary); read once per
    version of the file: every attempt of a task has the same."""
    try:
        info = path.stat()
    except OSError:
        return None
    return _read_instruction(path, info.st_mtime_ns, info.st_size)


@functools.lru_cache(maxsize=4096)
def _read_instruction(path: Path, mtime_ns: int, size: int) -> str | None:
    from harbor.models.task.task import strip_canary

    try:
        text: str = strip_canary(path.read_text())
    except (OSError, UnicodeDecodeError):
        return None
    return text


def _step_record(
    task_dir: Path, trial_dir: Path, step: dict[str, Any], reward_key: str | None
) -> dict[str, Any]:
    """One step's part of the line: a StepResult is classified as a trial's result is, its
    reward read by the run's `reward_key`."""
    name = str(step.get("step_name"))
    outcome = outcome_of_result(step, reward_key=reward_key)
    trajectory = trial_dir / "steps" / name / TRAJECTORY
    return {
        "name": name,
        "instruction": _instruction(task_dir / "steps" / name / "instruction.md"),
        "reward": outcome.reward,
        "rewards": outcome.rewards,
        "failure": outcome.failure,
        "message": outcome.message,
        "trajectory": str(trajectory) if trajectory.is_file() else None,
    }


def _token_totals(
    result: dict[str, Any],
) -> tuple[int | None, int | None, int | None, float | None]:
    """Harbor's own sums over the trial's agent runs (one, or one per step): its TrialResult's
    method, given only what it reads (building a TrialResult ran every field's default
    factory, the most of a line's time)."""
    # Harbor's models load when a line is written, not with every command.
    from harbor.models.agent.context import AgentContext
    from harbor.models.trial.result import TrialResult

    def context(data: Any) -> AgentContext | None:
        # The sums' fields alone: the rest (every turn's tokens) is what costs to validate.
        return AgentContext.model_validate({k: data.get(k) for k in SUMMED}) if data else None

    steps = [
        SimpleNamespace(agent_result=context(step.get("agent_result")))
        for step in result.get("step_results") or []
    ]
    read = SimpleNamespace(agent_result=context(result.get("agent_result")), step_results=steps)
    n_input, n_cache, n_output, cost = TrialResult.compute_token_cost_totals(
        cast("TrialResult", read)
    )
    return n_input, n_cache, n_output, cost


@dataclass
class Rollout:
    """A rollout record and what export checks and the trainer formats need from it."""

    line: dict[str, Any]
    turns: list[Turn]
    sequences: list[Sequence] | None
    llm_turns: int

    @property
    def missing_tokens(self) -> bool:
        """The agent's trajectory reports more model calls with output than carry token ids."""
        with_tokens = sum(1 for t in self.turns if t.completion_token_ids)
        return self.llm_turns > with_tokens


def _runs(result: dict[str, Any], trial_dir: Path | None) -> list[Conversation]:
    """The trial's agent runs: one, or one per step of a multi-step task."""
    if trial_dir is None:
        return []
    steps = result.get("step_results")
    if not steps:
        return [conversation(result.get("agent_result"), trial_dir / TRAJECTORY, None)]
    runs = []
    for step in steps:
        name = str(step.get("step_name"))
        trajectory = trial_dir / "steps" / name / TRAJECTORY
        runs.append(conversation(step.get("agent_result"), trajectory, name))
    return runs


def rollout(
    record: RunRecord,
    *,
    task: str,
    attempt: int,
    trial_dir: Path | None,
    result: dict[str, Any],
    outcome: Outcome,
    counts: bool,
    group_trainable: bool | None,
) -> Rollout:
    """The record of one trial of a run (`result` its parsed result.json), or of an attempt
    that ended without one (`result` empty; `trial_dir` None when it never got a trial);
    `group_trainable` whether every attempt of its task has ended trainable (None: not all have
    ended)."""
    task_dir = record.task_path(task)
    agent_info = result.get("agent_info") or {}
    model_info = agent_info.get("model_info") or {}
    steps = result.get("step_results") or []
    raised = [(r.get("exception_info") or {}).get("exception_type") for r in [result, *steps]]
    timed_out = AGENT_TIMEOUT in raised
    runs = _runs(result, trial_dir)
    turns = [turn for run in runs for turn in run.turns]
    mark_contiguity(turns)
    subagent_turns = [segment for run in runs for segment in run.subagent_turns]
    for segment in subagent_turns:
        mark_contiguity(segment)
    found = sequences(turns)
    n_input, n_cache, n_output, cost = _token_totals(result)
    trajectory = trial_dir / TRAJECTORY if trial_dir is not None else None
    line = {
        "schema": SCHEMA,
        "task": task,
        "attempt": attempt,
        "trial": trial_dir.name if trial_dir is not None else None,
        "trial_dir": str(trial_dir) if trial_dir is not None else None,
        "counts": counts,
        "trainable": outcome.trainable,
        "group": task,
        "group_size": record.attempts,
        "group_trainable": group_trainable,
        "partial": timed_out,
        "reward": outcome.reward,
        "rewards": outcome.rewards,
        "failure": outcome.failure,
        "message": outcome.message,
        "environment_limits": list(outcome.limits),
        "branch": read_branch(trial_dir) if trial_dir is not None else None,
        "instruction": None if steps else _instruction(task_dir / "instruction.md"),
        "steps": [_step_record(task_dir, trial_dir, s, record.reward_key) for s in steps]
        if steps and trial_dir is not None
        else None,
        "agent": agent_info.get("name") or record.agent,
        "agent_version": agent_info.get("version"),
        "model": model_info.get("name") or record.model,
        "started_at": result.get("started_at"),
        "finished_at": result.get("finished_at"),
        "timings": {phase: _seconds(result.get(phase)) for phase in TIMED_PHASES},
        "trajectory": str(trajectory) if trajectory is not None and trajectory.is_file() else None,
        "n_input_tokens": n_input,
        "n_output_tokens": n_output,
        "n_cache_tokens": n_cache,
        "cost_usd": cost,
        "turns": [turn.to_json() for turn in turns],
        **_flat(found),
        "subagent_turns": [[turn.to_json() for turn in segment] for segment in subagent_turns],
        "agent_metadata": (result.get("agent_result") or {}).get("metadata"),
    }
    return Rollout(line, turns, found, sum(run.llm_turns for run in runs))


def trial_rollout(
    trial_dir: Path, task_dir: Path, *, attempt: int = 0, reward_key: str | None = None
) -> dict[str, Any]:
    """The rollout line `export` would write for one Harbor trial that ran outside a
    harbor-hpc run (a trainer's own `Trial`, on a Ray cluster say): from the trial's folder and
    the task's, its reward the verifier's `reward_key` (None: `reward`, else a lone value).
    Raises `HarborHpcError` when the trial left no readable result.json."""
    result = read_json(trial_dir / "result.json")
    agent_info = result.get("agent_info") or {}
    record = RunRecord(
        tasks_root=str(task_dir.parent),
        tasks=[task_dir.name],
        agent=str(agent_info.get("name") or ""),
        model=(agent_info.get("model_info") or {}).get("name"),
        agent_kwargs={},
        environment="",
        environment_kwargs={},
        options={"reward_key": reward_key},
    )
    return rollout(
        record,
        task=task_dir.name,
        attempt=attempt,
        trial_dir=trial_dir,
        result=result,
        outcome=(outcome := outcome_of_trial(trial_dir, result, reward_key=reward_key)),
        counts=True,
        group_trainable=outcome.trainable,
    ).line
