"""`status`, `export` and `--wait`: where a run stands, read from its files and its live jobs.

`harbor_hpc.results` decides each attempt's state from the run's files and the set of its jobs
still alive, which the executor's side (`harbor_hpc.slurm.runs.live_jobs`) gives.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.results.export import Export, ExportFormat, export_run
from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.results.record import RunRecord, Unit, cancel_submissions, load_run
from harbor_hpc.results.status import RunStatus, attempt_statuses
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor
from harbor_hpc.slurm.runs import live_jobs
from harbor_hpc.steps.submit.waves import note_followed, queue_waiting

# `--wait` reads the run's files this often, and asks squeue (which every user of a login
# node shares) only every SQUEUE_EVERY_S: a trial's end shows first in its result.json.
FOLLOW_EVERY_S = 2.0
SQUEUE_EVERY_S = 15.0
log = logging.getLogger(__name__)


def run_status(run_dir: Path) -> RunStatus:
    """Every task attempt of the run in `run_dir`: pending, running, done or failed (why).
    Elements that wait for room under the user's limit on queued jobs are queued first, as
    far as the limit now allows."""
    try:
        queue_waiting(run_dir)
    except cluster.SlurmUnreachable as exc:
        log.warning("%s; the waiting elements stay waiting", exc.message)
    record = load_run(run_dir)
    return RunStatus.of(attempt_statuses(run_dir, record, live_jobs(record)))


def unset_agent_env(run_dir: Path) -> list[str]:
    """The run's `--agent-env` variables this process lacks while elements of it wait to be
    queued: without them `queue_waiting` queues nothing here (the agent would miss them)."""
    record = load_run(run_dir)
    if not any(sub.waits for sub in record.submissions):
        return []
    return [name for name in record.agent_env if name not in os.environ]


def export(
    run_dir: Path, out: Path, *, fmt: ExportFormat | str = ExportFormat.FULL, dry_run: bool = False
) -> Export:
    """The run's rollouts into `out` in `fmt`, each marked whether it is the trial `status`
    counts."""
    record = load_run(run_dir)
    trials = RunTrials(run_dir, reward_key=record.reward_key)
    statuses = attempt_statuses(run_dir, record, live_jobs(record), trials)
    return export_run(run_dir, out, statuses, fmt=fmt, dry_run=dry_run, trials=trials)


class _Squeue:
    """squeue's last answer on a run's jobs, which stands while Slurm's controller does not
    answer (`cluster.Silence`), with the jobs queued since taken as alive: a followed run, a
    trainer's batch, is not given up for a stall of the controller, and no attempt is taken
    for failed because squeue could not say it lives."""

    def __init__(self) -> None:
        self.alive: dict[str, str | None] = {}
        self.known: set[str] = set()  # the jobs recorded when squeue last answered
        self.silence = cluster.Silence()

    def ask(self, record: RunRecord) -> dict[str, str | None]:
        jobs = {c.job for sub in record.submissions for c in sub.chunks if c.job is not None}
        asked = time.monotonic()
        try:
            self.alive = live_jobs(record)
        except cluster.SlurmUnreachable as exc:
            self.silence.unanswered(exc, asked, "going on with its last answer and asking again")
            self.alive = {**self.alive, **dict.fromkeys(jobs - self.known)}
        else:
            self.silence.answered()
        self.known = jobs
        return self.alive


def follow(
    run_dir: Path, *, every_s: float = FOLLOW_EVERY_S, squeue_every_s: float = SQUEUE_EVERY_S
) -> Iterator[RunStatus]:
    """The run's status, again every `every_s`, until nothing is pending or running.

    Between two squeue calls the last answer stands: a job that ended since shows as ended
    once its trials' result.json files are there, or at the next call when it left none.
    squeue is asked after `squeue_every_s`, then twice as long after each answer, up to
    four times as long (15 s to a minute: a long run costs the controller two RPCs a minute);
    again after `squeue_every_s` once elements were queued. While elements wait for room
    under the user's limit on queued jobs, the room is asked of Slurm every `squeue_every_s`
    (one RPC), and what fits is queued (the run's elements, told so, leave that to this loop).
    While Slurm's controller does not answer, its last answer stands (`_Squeue`), asked again
    every `squeue_every_s`; waves wait for it to answer.
    """
    record = load_run(run_dir)
    if any(sub.waits for sub in record.submissions):
        note_followed(run_dir)
    squeue = _Squeue()
    alive = squeue.ask(record)
    asked = waves = time.monotonic()
    gap = squeue_every_s  # doubled after each answer
    while True:
        now = time.monotonic()
        if any(sub.waits for sub in record.submissions) and now - waves >= squeue_every_s:
            waves = now
            note_followed(run_dir)  # the elements leave the waves to this loop
            try:
                queued = queue_waiting(run_dir)
            except cluster.SlurmUnreachable as exc:  # one silence with squeue's
                meanwhile = "the waiting elements are queued once it answers"
                squeue.silence.unanswered(exc, now, meanwhile)
                queued = 0
            # What was queued is recorded, even when sbatch then did not answer.
            record = load_run(run_dir)
            if queued:  # squeue now (the new jobs must count as alive), then again soon
                asked, gap = -math.inf, squeue_every_s / 2
        if now - asked >= gap:
            alive, asked = squeue.ask(record), now
            silent = squeue.silence.since is not None
            gap = squeue_every_s if silent else min(gap * 2, squeue_every_s * 4)
        refuse_never_starting(alive)
        status = RunStatus.of(attempt_statuses(run_dir, record, alive))
        yield status
        if status.summary.finished:
            return
        time.sleep(every_s)


def refuse_never_starting(alive: dict[str, str | None]) -> None:
    """Cancel the run's jobs that Slurm will never start (they ask for more than the partition
    or the user's limits allow: `cluster.never_starts`) and say so, rather than wait for ever:
    their attempts end failed (infrastructure), for `resubmit` once what they ask is fixed."""
    never = {job: why for job, why in alive.items() if cluster.never_starts(why)}
    if not never:
        return
    cluster.cancel(*never)
    reasons = ", ".join(sorted(set(filter(None, never.values()))))
    jobs = sorted(never)
    shown = ", ".join(jobs[:5]) + (f" and {len(jobs) - 5} more" if len(jobs) > 5 else "")
    raise HarborHpcError(
        f"Slurm will never start job(s) {shown} ({reasons}: they ask for more than the "
        "partition, its nodes or your limits allow); cancelled them, their attempts failed",
        hint="ask for less (--mem, --cpus, --time, and what --sbatch-arg asks) or another "
        "--partition, then `harbor-hpc resubmit` the run",
    )


def cancel_run(run_dir: Path) -> None:
    """Stop what is left of the run: its workers end their trials within seconds (each ends
    `failed`/infrastructure, for `resubmit` to run again) and start no more, and its Slurm
    elements that have not started leave the queue (or, while Slurm's controller does not
    answer, end at once when they start). Finished trials stay as they are."""
    through = cancel_submissions(run_dir)
    record = load_run(run_dir)
    trials = RunTrials(run_dir, reward_key=record.reward_key)
    started = {(m.submission, Unit(m.task, m.attempt)) for m in trials.markers}
    waiting = [
        chunk.job
        for sub in record.submissions[:through]
        if sub.executor == Executor.SLURM
        for chunk in sub.chunks
        if chunk.job is not None and not any((sub.number, u) in started for u in chunk.units)
    ]
    if waiting:
        try:
            cluster.cancel(*waiting)
        except cluster.SlurmUnreachable as exc:  # the cancel holds: they start to end
            log.warning("%s; the run's queued elements end at once when they start", exc.message)
