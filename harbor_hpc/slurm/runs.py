"""The one thing about a run only the executor knows: which of its jobs still live.

`harbor_hpc.results` reads a run's files (markers, result.json) and decides each attempt's state
from them and from the set of live jobs it is handed (`harbor_hpc.steps.runs`); this module
makes that set. Slurm jobs:
one `squeue` call for the whole run. Local jobs: submitit's LocalExecutor runs each as a
controller process whose pid is the job id, so the question is asked of the process table,
here next to Slurm's, since it is the same question asked of the other executor (and the one
place that knows which job ids are pids).
"""

from __future__ import annotations

import socket

from harbor_hpc.results.record import RunRecord, Submission
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor


def live_jobs(record: RunRecord) -> dict[str, str | None]:
    """The ids of the run's jobs (array elements, local processes) still queued or running,
    each with Slurm's reason while it pends (None: it runs, or is a local process)."""
    queued = cluster.queue_reasons(
        [job for sub in record.submissions if sub.executor == Executor.SLURM for job in sub.job_ids]
    )
    alive: dict[str, str | None] = {}
    for sub in record.submissions:
        for job in (chunk.job for chunk in sub.chunks if chunk.job is not None):
            if sub.executor == Executor.SLURM:
                # An element, or its whole array when squeue prints the array's own id.
                for known in (job, job.split("_", 1)[0]):
                    if known in queued:
                        alive[job] = queued[known]
                        break
            elif _local_job_alive(sub, job):
                alive[job] = None
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
