"""Where every task attempt of a run stands, while the run goes on and after, without sacct.

Clusters often run without Slurm accounting, so a job's fate is pieced together from what is
left: the markers workers write when they start a trial, Harbor's result.json that a trial
writes when it ends, and which of the run's jobs still live. That last one only the executor
knows (squeue, or the local controller process): the caller hands it in as a set of job ids
(`harbor_hpc.slurm.runs` does), so this module only reads files. For each task attempt the
newest trial decides:

    result.json present                  done, or failed with the class of its exception
    marker only, its job alive           running
    marker only, its job gone            failed/infrastructure (job died or result lost)
    no marker, its job alive             pending
    no marker, its job gone              failed/infrastructure (job ended before the trial)
    never submitted (image missing)      failed/image
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from harbor_hpc.core.files import held_by_another
from harbor_hpc.results.classify import AttemptState, FailureClass, Outcome
from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.results.record import (
    CANCELLED,
    Marker,
    RunPaths,
    RunRecord,
    Submission,
    Unit,
    cancelled_through,
    waiting_for,
)


@dataclass(slots=True)
class AttemptStatus:
    task: str
    attempt: int
    trial: str | None
    state: AttemptState
    reward: float | None
    failure: FailureClass | None
    message: str | None
    # Where the trial's container was weaker than Docker's (containers/limits.py).
    limits: list[str] = field(default_factory=list)
    # Whether the policy alone made its outcome (classify.Outcome.trainable): a reward to learn
    # from. False while it has not ended.
    trainable: bool = False

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "limits": list(self.limits)
        }


@dataclass
class _JobFate:
    submission: Submission
    job: str | None
    alive: bool
    # Slurm's reason while the job pends (Priority, Resources, PartitionConfig...).
    reason: str | None = None


# What a pending attempt of an element not queued yet says first (then why).
NOT_QUEUED = "not queued yet"

# A pending attempt says why it waits (Slurm's reason) once its submission is this old.
WAIT_TOLD_S = 60.0


def _job_fates(
    record: RunRecord, alive: Collection[str] | Mapping[str, str | None]
) -> dict[Unit, _JobFate]:
    """For each unit, the job of the latest submission that included it, whether it lives, and
    why it pends."""
    reasons = alive if isinstance(alive, Mapping) else {}
    fates: dict[Unit, _JobFate] = {}
    for sub in record.submissions:
        for chunk in sub.chunks:
            lives = chunk.job is not None and chunk.job in alive
            reason = reasons.get(chunk.job) if chunk.job is not None else None
            for unit in chunk.units:
                fates[unit] = _JobFate(sub, chunk.job, lives, reason)
    return fates


def latest_markers(markers: list[Marker]) -> dict[Unit, Marker]:
    latest: dict[Unit, Marker] = {}
    for marker in markers:  # oldest first, so the newest wins
        latest[Unit(marker.task, marker.attempt)] = marker
    return latest


def attempt_statuses(
    run_dir: Path,
    record: RunRecord,
    alive: Collection[str] | Mapping[str, str | None],
    trials: RunTrials | None = None,
) -> list[AttemptStatus]:
    """One status per task attempt of the run, in task order; `alive` holds the ids of the
    run's jobs (array elements, local processes) that are still queued or running (as a
    mapping: with Slurm's reason while each pends, which a pending attempt says once its
    submission is WAIT_TOLD_S old); `trials` the run's trials, when the caller read them."""
    fates = _job_fates(record, alive)
    trials = trials or RunTrials(run_dir, reward_key=record.reward_key)
    newest = latest_markers(trials.markers)
    cancelled = cancelled_through(run_dir)  # read once: every never-started attempt asks
    # A submit or resubmit queueing the run's jobs right now (its lock held): what it has not
    # queued yet waits, it has not failed.
    submitting = held_by_another(RunPaths(run_dir).submit_lock)
    units = record.units()
    counted: list[Marker | None] = []
    for unit in units:
        marker, fate = newest.get(unit), fates.get(unit)
        # A resubmission newer than the marker supersedes that trial: the unit runs again.
        superseded = (marker and fate and fate.submission.number > marker.submission) or (
            marker and not record.counts(unit.task, marker.submission)  # the task changed
        )
        counted.append(None if superseded else marker)
    outcomes = iter(trials.outcomes(m for m in counted if m is not None))
    return [
        _status_of(
            run_dir,
            record,
            unit,
            marker,
            None if marker is None else next(outcomes),
            fates.get(unit),
            cancelled,
            submitting,
        )
        for unit, marker in zip(units, counted, strict=True)
    ]


def _status_of(
    run_dir: Path,
    record: RunRecord,
    unit: Unit,
    marker: Marker | None,
    outcome: Outcome | None,
    fate: _JobFate | None,
    cancelled: int,
    submitting: bool,
) -> AttemptStatus:
    """`marker`: the newest trial of `unit` that counts, and `outcome` what it came to (None:
    it has not ended); `cancelled`: the run's last cancelled submission (`cancelled_through`);
    `submitting`: another process is queueing the run's jobs now."""

    def status(
        state: AttemptState, failure: FailureClass | None = None, message: str | None = None
    ) -> AttemptStatus:
        trial = marker.trial if marker else None
        return AttemptStatus(unit.task, unit.attempt, trial, state, None, failure, message)

    if marker is not None and outcome is not None:
        return AttemptStatus(
            unit.task,
            unit.attempt,
            marker.trial,
            outcome.state,
            outcome.reward,
            outcome.failure,
            outcome.message,
            list(outcome.limits),
            outcome.trainable,
        )
    if fate is not None and fate.alive:
        if marker is not None:
            waits = waiting_for(RunPaths(run_dir).trial(marker.trial))
            return status(AttemptState.RUNNING, message=waits)
        waited = time.time() - _epoch(fate.submission.submitted_at)
        why = f"Slurm: {fate.reason}" if fate.reason and waited >= WAIT_TOLD_S else None
        return status(AttemptState.PENDING, message=why)
    failed, lost = AttemptState.FAILED, FailureClass.INFRASTRUCTURE
    if unit.task in record.image_problems and marker is None:
        return status(failed, FailureClass.IMAGE, record.image_problems[unit.task])
    if marker is not None:
        trial_dir = RunPaths(run_dir).trial(marker.trial)
        if not trial_dir.exists():
            return status(failed, lost, "no result: the trial folder is gone")
        why = out_of_memory(run_dir, marker.job) or (
            "cancelled, killed, out of time or node failure"
        )
        return status(
            failed,
            lost,
            f"no result: job {marker.job} ended before the trial wrote result.json ({why})",
        )
    if (fate is None or fate.job is None) and submitting:
        return status(AttemptState.PENDING)
    if fate is None:
        return status(failed, lost, "never submitted")
    if fate.job is None and cancelled >= fate.submission.number:
        return status(failed, lost, f"not started: {CANCELLED} came before it was queued")
    if fate.job is None and fate.submission.waits:
        return status(AttemptState.PENDING, message=f"{NOT_QUEUED}: {fate.submission.waiting}")
    if fate.job is None:
        return status(failed, lost, "its submission failed before a job was queued")
    if cancelled >= fate.submission.number:
        return status(failed, lost, f"not started: {CANCELLED} stopped job {fate.job} first")
    log = RunPaths(run_dir).submitit / fate.job
    why = (
        out_of_memory(run_dir, fate.job) or f"cancelled, killed, or it failed: see its log in {log}"
    )
    return status(failed, lost, f"job {fate.job} ended before this trial started ({why})")


def _epoch(iso: str) -> float:
    try:
        return datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return 0.0  # an older record's odd stamp: old enough


# What slurmstepd writes to a job's stderr when the cgroup's OOM killer ended processes of it.
_OOM_KILL = re.compile(rb"Detected (\d+) oom[-_]kill event")
# The end of a job's log is read, where slurmstepd writes as the job ends.
_LOG_TAIL_BYTES = 64 * 1024


def out_of_memory(run_dir: Path, job: str | None) -> str | None:
    """Why job `job` ended, when Slurm's cgroup killed processes of it for memory (its log
    says so): the element's own processes (harbor-hpc's worker, Harbor) outgrew what the element
    asked for beside its trials' memory_mb, which the watchdog holds each trial to."""
    if job is None:
        return None
    for log in sorted((RunPaths(run_dir).submitit / job).glob("*_log.err")):
        try:
            with log.open("rb") as file:
                file.seek(max(0, file.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                found = _OOM_KILL.search(file.read())
        except OSError:
            continue
        if found:
            return (
                f"Slurm's cgroup killed {found.group(1).decode()} process(es) of it for memory: "
                "the element's processes outgrew its memory request; give it more "
                "(--mem, or fewer trials at once with --concurrency)"
            )
    return None


@dataclass
class Summary:
    states: dict[str, int]
    failures: dict[str, int]
    mean_reward: float | None
    total: int
    # Why attempts wait, counted: Slurm's reasons, once they have waited a minute; a started
    # trial's own (no Ray node with room yet).
    waiting: dict[str, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.states[AttemptState.PENDING] + self.states[AttemptState.RUNNING] == 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(statuses: list[AttemptStatus]) -> Summary:
    states = Counter(s.state for s in statuses)
    failures = Counter(s.failure for s in statuses if s.failure)
    rewards = [s.reward for s in statuses if s.state == AttemptState.DONE and s.reward is not None]
    going = (AttemptState.PENDING, AttemptState.RUNNING)
    waiting = Counter(s.message for s in statuses if s.state in going and s.message)
    return Summary(
        states={str(state): states.get(state, 0) for state in AttemptState},
        failures=dict(sorted(failures.items())),
        mean_reward=sum(rewards) / len(rewards) if rewards else None,
        total=len(statuses),
        waiting=dict(sorted(waiting.items())),
    )


@dataclass
class RunStatus:
    """Every attempt of a run and their counts: what `status` shows and `--wait` follows."""

    attempts: list[AttemptStatus]
    summary: Summary

    @classmethod
    def of(cls, attempts: list[AttemptStatus]) -> RunStatus:
        return cls(attempts, summarize(attempts))

    def to_json(self) -> list[dict[str, Any]]:
        return [attempt.to_json() for attempt in self.attempts]
