"""A run's rollouts as JSON lines, in our full schema or in the shape a trainer reads.

`full` (schema `harbor-hpc/rollout/v5`, built in `results/rollout.py`): one line per trial that
ended, reruns included, plus one per attempt that failed without a result (an image missing, a
job that died); `counts` marks the one line per attempt that `status` reports (a rerun after a
cancelled job or `resubmit --failed` supersedes the trials before it).

The trainer formats take only what a trainer may learn from: the line that counts, `trainable`,
with token ids; every other line is left out and counted by reason. A trial's main conversation
can be more than one sequence (the flattening restarts where a prompt rewrote the history):
each sequence is a line of its own, `sequence` i of `sequences`, so that every line is a context
the model saw. The reward of an agent that failed before its verifier ran is 0.0, as trainers
score such rollouts.

    harbor-rl   task, attempt, trial, sequence, sequences, partial, environment_limits, reward,
                token_ids, mask_ids (1: produced by the policy), logprobs (0.0 where mask 0):
                the flattened fields.
    nemo-gym    NeMo Gym's rollout line, as its Harbor agent writes it and NeMo RL reads it:
                `responses_create_params.input` (the first turn's input messages),
                `response.output` (per turn an assistant message with prompt_token_ids,
                generation_token_ids and generation_log_probs, then its function_call and
                function_call_output items), `reward`, `instance_id` (the task), `metadata`
                (the harbor-rl line's fields without the tokens and the reward, `trial_dir`).

Both carry `environment_limits`: where the trial's container was weaker than Docker's (no subuid
range, no network of its own, writes in memory: containers/limits.py), one sentence each, empty
where it ran as in Docker. Such a reward stands (Harbor's policy), but may differ from Docker's:
a trainer that wants only rewards Docker would give drops the lines that name a limit.

A run that asked for token ids (agent kwarg `collect_rollout_details`) and got none for some
model call of a trainable trial writes nothing: the model server did not send them.
"""

from __future__ import annotations

import errno
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from harbor_hpc.core.errors import HarborHpcError, InputError, choice, from_os_error
from harbor_hpc.core.files import atomic_write_chunks, read_in_threads, read_json
from harbor_hpc.results.classify import AttemptState, Outcome, outcome_of_trial, rewards_of
from harbor_hpc.results.outcomes import RunTrials, trial_outcome
from harbor_hpc.results.record import Marker, RunPaths, RunRecord, load_run, run_umask
from harbor_hpc.results.rollout import Rollout, Sequence, rollout
from harbor_hpc.results.status import AttemptStatus

TOKENS_KWARG = "collect_rollout_details"  # terminus-2's (and Harbor's LiteLLM's) switch


class ExportFormat(StrEnum):
    FULL = "full"
    HARBOR_RL = "harbor-rl"
    NEMO_GYM = "nemo-gym"


class LeftOut(StrEnum):
    """Why a rollout has no line in a trainer format."""

    SUPERSEDED = "superseded"  # a later trial of its attempt counts
    NOT_TRAINABLE = "not_trainable"  # the cluster, image, task or verifier failed it
    NO_TOKENS = "no_tokens"  # no turn, or a turn without token ids or log-probs


def group_verdicts(record: RunRecord, statuses: list[AttemptStatus]) -> dict[str, bool | None]:
    """Per task of `statuses`, whether its group (its attempts) may be trained on whole: True
    when every attempt has ended trainable, False once one has ended otherwise, None while
    some have not ended (or are not among `statuses`) and none has failed the group yet."""
    by_task: dict[str, list[AttemptStatus]] = {}
    for status in statuses:
        by_task.setdefault(status.task, []).append(status)
    verdicts: dict[str, bool | None] = {}
    for task, group in by_task.items():
        ended = [s for s in group if s.state in (AttemptState.DONE, AttemptState.FAILED)]
        if any(not s.trainable for s in ended):
            verdicts[task] = False
        else:
            verdicts[task] = True if len(ended) == record.attempts else None
    return verdicts


def iter_rollouts(
    run_dir: Path,
    record: RunRecord,
    statuses: list[AttemptStatus],
    groups: list[AttemptStatus] | None = None,
    trials: RunTrials | None = None,
) -> Iterator[Rollout]:
    """Every trial of the attempts in `statuses` that left a result.json, oldest first, then
    every attempt `statuses` reports failed without one, one at a time; each line's group
    judged on `groups` (the run's statuses; default `statuses`). A trial a status counts is
    judged as that status judged it, and one the outcomes index holds as it says: each trial's
    folder is read once, for its line, several at a time (`trials`: the run's, when the caller
    read them)."""
    paths = RunPaths(run_dir)
    verdicts = group_verdicts(record, statuses if groups is None else groups)
    counted = {s.trial: s for s in statuses if s.trial is not None}
    attempts = {(s.task, s.attempt) for s in statuses}
    trials = trials or RunTrials(run_dir, reward_key=record.reward_key)

    def line(marker: Marker) -> Rollout | None:
        trial_dir = paths.trial(marker.trial)
        try:
            result = read_json(trial_dir / "result.json")
        except HarborHpcError:
            return None  # none, or unreadable: its attempt's status says so, and gets a line below
        status = counted.get(marker.trial)
        if status is not None and status.state in (AttemptState.DONE, AttemptState.FAILED):
            outcome = Outcome(
                status.failure,
                status.message,
                status.reward,
                rewards_of(result),
                valid=status.trainable,
                limits=tuple(status.limits),
            )
        else:
            outcome = trials.noted(marker.trial) or trial_outcome(
                marker, outcome_of_trial(trial_dir, result, reward_key=record.reward_key)
            )
        return rollout(
            record,
            task=marker.task,
            attempt=marker.attempt,
            trial_dir=trial_dir,
            result=result,
            outcome=outcome,
            counts=status is not None,
            group_trainable=verdicts.get(marker.task),
        )

    seen: set[str] = set()
    wanted = [m for m in trials.markers if (m.task, m.attempt) in attempts]
    for made in read_in_threads(line, wanted):
        if made is not None:
            seen.add(str(made.line["trial"]))
            yield made
    for status in statuses:
        if status.state is AttemptState.FAILED and status.trial not in seen:
            outcome = Outcome(
                status.failure, status.message, status.reward, {}, limits=tuple(status.limits)
            )
            yield rollout(
                record,
                task=status.task,
                attempt=status.attempt,
                trial_dir=None if status.trial is None else paths.trial(status.trial),
                result={},
                outcome=outcome,
                counts=True,
                group_trainable=verdicts.get(status.task),
            )


def _refuse_tokenless_format(run_dir: Path, record: RunRecord, fmt: ExportFormat) -> None:
    if record.agent_kwargs.get(TOKENS_KWARG) is not True and fmt is not ExportFormat.FULL:
        raise InputError(
            f"{run_dir}: the run did not collect token ids, which --format {fmt} is made of",
            hint=f"export --format full, or submit again with --agent-kwarg {TOKENS_KWARG}=true",
        )


def _tokens_missing(run_dir: Path, missing: list[str]) -> HarborHpcError:
    return HarborHpcError(
        f"{run_dir}: the run asked for token ids ({TOKENS_KWARG}=true) but "
        f"{len(missing)} trial(s) have model calls without them: {', '.join(missing)}",
        hint="the model server must send them (vLLM's OpenAI server does, asked with "
        "return_token_ids); nothing was written",
    )


def _text(content: Any) -> str:
    """A message's text: ATIF content is a string or a list of content parts."""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def _nemo_gym_items(
    messages: list[dict[str, Any]], tokens: dict[str, Any], *, inputs: bool
) -> list[dict[str, Any]]:
    """One turn as NeMo Gym output items; `inputs` when its input messages are items too (they
    are `responses_create_params.input` for the first turn)."""
    items: list[dict[str, Any]] = []
    replied = False
    for message in messages or [{"role": "assistant", "content": ""}]:
        role = message.get("role")
        if role == "assistant":
            replied = True
            text = {"type": "output_text", "text": _text(message.get("content")), "annotations": []}
            items.append(
                {"type": "message", "role": "assistant", "status": "completed", "content": [text]}
                | tokens
            )
            for call in message.get("tool_calls") or []:
                arguments = call.get("arguments")
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": call.get("name"),
                        "arguments": json.dumps(arguments)
                        if not isinstance(arguments, str)
                        else arguments,
                        "status": "completed",
                    }
                )
        elif role == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.get("tool_call_id"),
                    "output": _text(message.get("content")),
                }
            )
        elif inputs or replied:
            items.append(
                {"type": "message", "role": role, "content": _text(message.get("content"))}
            )
    return items


def _input_messages(sequence: Sequence) -> list[dict[str, Any]]:
    """What the first turn of `sequence` was given before it replied."""
    given = []
    for message in sequence.turns[0].messages or []:
        if message.get("role") == "assistant":
            break
        given.append(
            {
                "role": message.get("role"),
                "content": _text(message.get("content")),
                "type": "message",
            }
        )
    return given


def _trainer_lines(r: Rollout, fmt: ExportFormat) -> list[dict[str, Any]]:
    line, found = r.line, r.sequences or []
    ids = {"task": line["task"], "attempt": line["attempt"], "trial": line["trial"]}
    reward = line["reward"]  # a trainable line always has one
    lines = []
    for number, sequence in enumerate(found):
        where = {
            **ids,
            "group": line["group"],
            "group_size": line["group_size"],
            "group_trainable": line["group_trainable"],
            "sequence": number,
            "sequences": len(found),
            "partial": line["partial"],
            "environment_limits": line["environment_limits"],
            "branch": line["branch"],
        }
        if fmt is ExportFormat.HARBOR_RL:
            lines.append(
                {
                    **where,
                    "reward": reward,
                    "token_ids": sequence.token_ids,
                    "mask_ids": sequence.mask_ids,
                    "logprobs": sequence.logprobs,
                }
            )
            continue
        output = []
        for index, turn in enumerate(sequence.turns):
            tokens = {
                "prompt_token_ids": turn.prompt_token_ids,
                "generation_token_ids": turn.completion_token_ids,
                "generation_log_probs": turn.logprobs,
            }
            output += _nemo_gym_items(turn.messages or [], tokens, inputs=index > 0)
        lines.append(
            {
                "responses_create_params": {"input": _input_messages(sequence)},
                "response": {
                    "id": f"resp_{line['trial']}_{number}",
                    "object": "response",
                    "model": line["model"],
                    "status": "completed",
                    "output": output,
                },
                "reward": reward,
                "instance_id": line["task"],
                "metadata": {**where, "trial_dir": line["trial_dir"]},
            }
        )
    return lines


def _why_left_out(r: Rollout, fmt: ExportFormat) -> LeftOut | None:
    if not r.line["counts"]:
        return LeftOut.SUPERSEDED
    if not r.line["trainable"]:
        return LeftOut.NOT_TRAINABLE
    if not r.sequences or (
        fmt is ExportFormat.NEMO_GYM and any(s.logprobs is None for s in r.sequences)
    ):
        return LeftOut.NO_TOKENS
    return None


@dataclass(frozen=True)
class Export:
    """How many lines went (or, in a dry run, would go) to `out`, and how many rollouts a
    trainer format left out, by reason."""

    out: Path
    format: ExportFormat
    rollouts: int
    left_out: dict[str, int]
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "format": self.format,
            "rollouts": self.rollouts,
            "left_out": self.left_out,
            "dry_run": self.dry_run,
        }


def _lines(
    run_dir: Path,
    record: RunRecord,
    statuses: list[AttemptStatus],
    fmt: ExportFormat,
    groups: list[AttemptStatus] | None,
    left_out: Counter[str],
    trials: RunTrials | None = None,
) -> Iterator[dict[str, Any]]:
    """The lines of `rollout_lines`, one rollout at a time; `left_out` counts what a trainer
    format leaves out. A trainable trial without the token ids its run asked for ends it (after
    the last line: every such trial named)."""
    _refuse_tokenless_format(run_dir, record, fmt)
    asked = record.agent_kwargs.get(TOKENS_KWARG) is True
    missing: list[str] = []
    for r in iter_rollouts(run_dir, record, statuses, groups, trials):
        if asked and r.line["trainable"] and r.missing_tokens:
            missing.append(str(r.line["trial"]))
        if fmt is ExportFormat.FULL:
            yield r.line
            continue
        why = _why_left_out(r, fmt)
        if why is None:
            yield from _trainer_lines(r, fmt)
        else:
            left_out[why] += 1
    if missing:
        raise _tokens_missing(run_dir, missing)


def rollout_lines(
    run_dir: Path,
    statuses: list[AttemptStatus],
    *,
    fmt: ExportFormat | str = ExportFormat.FULL,
    groups: list[AttemptStatus] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The rollouts of the attempts in `statuses` (all the run's: what `export` writes) in
    `fmt`, the lines they count marked, and how many rollouts a trainer format left out, by
    reason; groups are judged on `groups` (the whole run's statuses, where `statuses` are
    some of them; default `statuses`). `fmt` is an ExportFormat or its value; anything else is
    refused."""
    fmt = choice(ExportFormat, fmt, "format")
    left_out: Counter[str] = Counter()
    run_dir = run_dir.resolve()
    lines = list(_lines(run_dir, load_run(run_dir), statuses, fmt, groups, left_out))
    return lines, dict(left_out)


def export_run(
    run_dir: Path,
    out: Path,
    statuses: list[AttemptStatus],
    *,
    fmt: ExportFormat | str = ExportFormat.FULL,
    dry_run: bool = False,
    trials: RunTrials | None = None,
) -> Export:
    """Write the run's rollouts to `out` (JSONL, atomically, each line as it is made: a run of
    tens of thousands of trials is never held whole) in `fmt`, marking the lines `statuses`
    count (`trials`: the run's, when the caller read them). The file is as private as the run:
    its owner's (0600), or with the run's `--group-readable` also readable by the group
    (0640)."""
    fmt = choice(ExportFormat, fmt, "format")
    run_dir = run_dir.resolve()
    left_out: Counter[str] = Counter()
    written = 0
    record = load_run(run_dir)

    def encoded() -> Iterator[bytes]:
        nonlocal written
        for line in _lines(run_dir, record, statuses, fmt, None, left_out, trials):
            written += 1
            yield (json.dumps(line, default=str) + "\n").encode()

    if dry_run:
        for _ in encoded():
            pass
        return Export(out, fmt, written, dict(left_out), dry_run)
    mode = 0o666 & ~run_umask(record.group_readable)
    try:
        atomic_write_chunks(out, encoded(), mode=mode)
    except OSError as exc:  # a full disk; --out a folder, or in one it cannot write
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise from_os_error(exc, out) or exc from None
        raise InputError(
            f"{out}: cannot write the rollouts ({exc.strerror})",
            hint="give --out a file path in a folder you can write",
        ) from None
    return Export(out, fmt, written, dict(left_out), dry_run)
