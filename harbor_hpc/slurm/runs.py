"""Where a run stands, with the one thing only the executor knows: which of its jobs still live.

`harbor_hpc.results` reads a run's files (markers, result.json) and decides each attempt's state
from them and from the set of live jobs it is handed; this module makes that set. Slurm jobs:
one `squeue` call for the whole run. Local jobs: submitit's LocalExecutor runs each as a
controller process whose pid is the job id, so the question is asked of the process table,
here next to Slurm's, since it is the same question asked of the other executor (and the one
place that knows which job ids are pids).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

from harbor_hpc.results.export import Export, ExportFormat, export_run
from harbor_hpc.results.record import RunRecord, Submission, load_run
from harbor_hpc.results.status import RunStatus, attempt_statuses
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor

# `--wait` reads the run's files this often, and asks squeue (which every user of a login
# node shares) only every SQUEUE_EVERY_S: a trial's end shows first in its result.json.
FOLLOW_EVERY_S = 2.0
SQUEUE_EVERY_S = 15.0


def live_jobs(record: RunRecord) -> set[str]:
    """The ids of the run's jobs (array elements, local processes) still queued or running."""
    queued = cluster.queued_jobs(
        [job for sub in record.submissions if sub.executor == Executor.SLURM for job in sub.job_ids]
    )
    alive = set()
    for sub in record.submissions:
        for job in (chunk.job for chunk in sub.chunks if chunk.job is not None):
            if sub.executor == Executor.SLURM:
                # An element, or its whole array when squeue prints the array's own id.
                lives = job in queued or job.split("_", 1)[0] in queued
            else:
                lives = _local_job_alive(sub, job)
            if lives:
                alive.add(job)
    return alive


def _local_job_alive(submission: Submission, job: str) -> bool:
    """A local job is its controller process; from another host its fate cannot be seen."""
    if submission.host != socket.gethostname():
        return True
    import psutil  # here: `status` of a Slurm run needs none of it

    try:
        process = psutil.Process(int(job))
        return process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False


def run_status(run_dir: Path) -> RunStatus:
    """Every task attempt of the run in `run_dir`: pending, running, done or failed (why)."""
    record = load_run(run_dir)
    return RunStatus.of(attempt_statuses(run_dir, record, live_jobs(record)))


def export(
    run_dir: Path, out: Path, *, fmt: ExportFormat = ExportFormat.FULL, dry_run: bool = False
) -> Export:
    """The run's rollouts into `out` in `fmt`, each marked whether it is the trial `status`
    counts."""
    return export_run(run_dir, out, run_status(run_dir).attempts, fmt=fmt, dry_run=dry_run)


def follow(
    run_dir: Path, *, every_s: float = FOLLOW_EVERY_S, squeue_every_s: float = SQUEUE_EVERY_S
) -> Iterator[RunStatus]:
    """The run's status, again every `every_s`, until nothing is pending or running.

    Between two squeue calls the last answer stands: a job that ended since shows as ended
    once its trials' result.json files are there, or at the next call when it left none.
    """
    record = load_run(run_dir)
    alive = live_jobs(record)
    asked = time.monotonic()
    while True:
        if time.monotonic() - asked >= squeue_every_s:
            alive, asked = live_jobs(record), time.monotonic()
        status = RunStatus.of(attempt_statuses(run_dir, record, alive))
        yield status
        if status.summary.finished:
            return
        time.sleep(every_s)
