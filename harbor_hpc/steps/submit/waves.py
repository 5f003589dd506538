"""Waves: a submission's elements queued as far as the cluster takes them now, the rest recorded
as waiting (`Submission.waiting`) and queued as room frees under the user's limit on queued jobs.

`queue_chunks` queues (submit, resubmit); `queue_waiting` queues what waits and now fits, called
by whatever looks at the run (`status`, `--wait` and the Python API, steps/runs.py) and by each
element once its trials ended (`queue_unfollowed`, handed to the worker: it imports this module,
light, not the rest of submit). While a follower looks at the run (`note_followed`), the
elements leave the waves to it: one look at the room for all.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from harbor_hpc.core.files import LockTimeout, file_lock
from harbor_hpc.results.record import RunPaths, RunRecord, cancelled_through, load_run, update_run
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, JobRequest
from harbor_hpc.slurm.resources import Resources
from harbor_hpc.slurm.worker import ChunkWorker
from harbor_hpc.steps.submit.options import recorded_placement

# Held while `exported` values are in this process's environment: one queueing at a time.
_exporting = threading.Lock()


@contextlib.contextmanager
def exported(values: Mapping[str, str]) -> Iterator[None]:
    """`values` (`--agent-env NAME=VALUE`) in this process's environment while jobs are
    queued, which sbatch hands to the jobs and local jobs inherit; gone again after. (Never
    on a command line, which any user of the machine reads.) Batches a trainer runs at once,
    each from a thread, queue one after the other: one that ended would take the values away
    from under the other's sbatch, whose jobs would run the agent without them."""
    with _exporting:
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, old in saved.items():
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old


# The `--agent-env` values given to this process's submits, by run folder: elements that wait
# to be queued get them when `queue_waiting` queues them here. (Never written down.)
agent_env_values: dict[Path, dict[str, str]] = {}

# Why a submission's other elements wait to be queued (the run's record and `status` say it).
SUBMIT_LIMIT_REACHED = "Slurm's limit on your queued jobs (MaxSubmitJobs) is reached"


_HINT = "check --partition/--account/--qos and the resources"


def queue_chunks(run_dir: Path, number: int, env: Mapping[str, str] | None = None) -> int:
    """Queue the chunks of submission `number` that have no job yet, as many as the cluster
    takes now: one array job per group of equal resources, no more elements an array than
    MaxArraySize, none past the user's limit on queued jobs (asked of Slurm once; sbatch's
    refusal for it halves the array). Each array's ids are recorded as soon as Slurm gives
    them; what does not fit is recorded as waiting (`Submission.waiting`), for `queue_waiting`.
    `env`: the `--agent-env` values given, in the environment the jobs get. Returns how many
    elements were queued. The caller holds the run's submit lock."""
    record = load_run(run_dir)
    submission = record.submissions[number - 1]
    executor = Executor(submission.executor)
    slurm = executor is Executor.SLURM
    room = cluster.submit_room(getpass.getuser()) if slurm else None
    array_limit = cluster.max_array_size() if slurm and room != 0 else None
    # Each element, once its trials ended, queues what waits and now fits (the room it frees
    # counts at the next element's end): waves go on with nobody following the run.
    then = queue_unfollowed if slurm else None
    worker = ChunkWorker(str(run_dir), number, int(record.options["concurrency"]), then)
    by_resources: dict[str, list[int]] = {}
    for index, chunk in enumerate(submission.chunks):
        if chunk.job is None:
            by_resources.setdefault(json.dumps(chunk.resources, sort_keys=True), []).append(index)
    queued = 0
    waiting: str | None = None
    with exported(env or {}):
        for resources, indices in by_resources.items():
            request = _request(run_dir, record, Resources.of_json(json.loads(resources)))
            pool = cluster.executor(RunPaths(run_dir).submitit / "%j", executor, request)
            while indices and waiting is None:
                size = min(len(indices), array_limit or len(indices))
                if room is not None:
                    size = min(size, room)
                if size == 0:
                    if not any(c.resources == submission.chunks[indices[0]].resources
                               and c.job for c in submission.chunks):  # fmt: skip
                        # None of these went out yet: what sbatch would refuse is said now.
                        cluster.try_request(request, what="the run's array job", hint=_HINT)
                    waiting = SUBMIT_LIMIT_REACHED
                    break
                part = indices[:size]
                try:
                    jobs = cluster.submit_array(
                        pool,
                        worker,
                        [[u.to_json() for u in submission.chunks[i].units] for i in part],
                        what="the run's array job",
                        hint=_HINT,
                    )
                except cluster.SubmitLimitReached:
                    room = size // 2  # a limit Slurm did not name (a QOS's): less, until one
                    continue
                with update_run(run_dir) as fresh:
                    for i, job in zip(part, jobs, strict=True):
                        fresh.submissions[number - 1].chunks[i].job = job.job_id
                queued += size
                indices = indices[size:]
                if room is not None:
                    room -= size
    with update_run(run_dir) as fresh:
        fresh.submissions[number - 1].waiting = waiting
    return queued


def queue_waiting(run_dir: Path, env: Mapping[str, str] | None = None) -> int:
    """Queue what the cluster takes now of the run's elements that wait to be queued (a
    limit on queued jobs held them back), unless a submit or resubmit of the run is under way,
    the run was cancelled or is another user's. Returns how many elements were queued."""
    try:
        owner = run_dir.stat().st_uid
    except OSError:
        return 0  # no run there: reading it says so
    if owner != os.getuid():
        return 0  # another user's run (its group may read it): only its owner queues
    record = load_run(run_dir)
    cancelled = cancelled_through(run_dir)
    numbers = [s.number for s in record.submissions if s.waits and s.number > cancelled]
    env = agent_env_values.get(run_dir, {}) if env is None else env
    if not numbers or any(n not in os.environ and n not in env for n in record.agent_env):
        return 0  # nothing waits, or the agent's variables are not here to hand on
    try:
        with file_lock(RunPaths(run_dir).submit_lock, timeout=0):
            return sum(queue_chunks(run_dir, number, env) for number in numbers)
    except LockTimeout:
        return 0  # another process queues them


# Elements leave the waves to a follower of the run (`--wait`, the Python API: one look at the
# room for all, every 15 s) that looked this recently.
FOLLOWED_WITHIN_S = 60.0


def note_followed(run_dir: Path) -> None:
    """Say that a follower of the run queues its waiting elements (`queue_unfollowed`)."""
    with contextlib.suppress(OSError):  # another user's run, read through its group
        RunPaths(run_dir).followed.touch()


def queue_unfollowed(run_dir: Path) -> int:
    """`queue_waiting`, unless a follower of the run does it (`note_followed` within
    FOLLOWED_WITHIN_S): what an element does once its trials ended, so that a run nobody
    follows goes on in waves, at no more cost to slurmctld while one does."""
    with contextlib.suppress(OSError):
        if time.time() - RunPaths(run_dir).followed.stat().st_mtime < FOLLOWED_WITHIN_S:
            return 0
    return queue_waiting(run_dir)


def _request(run_dir: Path, record: RunRecord, resources: Resources) -> JobRequest:
    """What each element of `record`'s arrays of `resources` asks of Slurm."""
    return JobRequest(
        name=f"harbor-hpc:{run_dir.name}",
        time_min=resources.time_min,
        mem_mb=resources.mem_mb,
        cpus=resources.cpus,
        gpus=resources.gpus,
        gpu_type=next(iter(resources.gpu_types), None),
        placement=recorded_placement(record.options),
        array_parallelism=record.options.get("array_parallelism"),
    )
