"""Our executor against the real Slurm: arrays, MaxArraySize, and squeue as the only job oracle."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import submitit

from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, JobRequest


def square(x: int) -> int:
    return x * x


@pytest.mark.slurm
def test_an_array_runs_and_leaves_the_queue(tmp_path: Path) -> None:
    assert cluster.max_array_size() > 1
    limits = cluster.partition_limits(None)
    assert limits is not None and limits.cpus >= 1
    request = JobRequest("harbor-hpc-test", time_min=2, mem_mb=200, cpus=1, array_parallelism=2)
    pool = cluster.executor(tmp_path / "%j", Executor.SLURM, request)
    jobs = cluster.submit_array(pool, square, [2, 3], what="the test array", hint="")
    ids = [job.job_id for job in jobs]
    assert ids[0].endswith("_0") and ids[1].endswith("_1")
    base = ids[0].split("_")[0]
    deadline = time.monotonic() + 120
    while cluster.queued_jobs([base]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not cluster.queued_jobs([base])
    assert [job.result() for job in jobs] == [4, 9]


def run_long(folder: str) -> None:
    """Say it runs (submitit's signal handlers are in place before this is called), then wait."""
    (Path(folder) / "running").write_text("")
    time.sleep(300)


@pytest.mark.slurm
def test_an_element_is_its_batch_script_and_gets_the_requeue_warning(tmp_path: Path) -> None:
    # No srun step in an element (a step costs the controller two RPCs): its Python is the batch
    # shell itself (exec), which is what Slurm's warning before the time limit reaches (B:).
    request = JobRequest("harbor-hpc-test", time_min=30, mem_mb=200, cpus=1)
    pool = cluster.executor(tmp_path / "%j", Executor.SLURM, request)
    [job] = cluster.submit_array(pool, run_long, [str(tmp_path)], what="the test array", hint="")
    script = next(tmp_path.rglob("*_submission.sh")).read_text()
    assert not [line for line in script.splitlines() if line.startswith("srun")]
    assert "\nexec " in script
    assert "#SBATCH --signal=B:USR2@" in script
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "running").exists():
            assert time.monotonic() < deadline, _logs(job) or "the element did not start"
            time.sleep(0.5)
        # What Slurm sends the batch shell before the time limit (--signal=B:USR2@...).
        signal = ["scancel", "--batch", "--signal=USR2", job.job_id]
        subprocess.run(signal, check=True, timeout=30)
        # submitit's handler in the element's Python takes it, and asks Slurm to requeue.
        while "this job is preempted" not in _logs(job):
            assert time.monotonic() < deadline, _logs(job)
            time.sleep(0.5)
    finally:
        cluster.cancel(job.job_id)


def _logs(job: submitit.Job[None]) -> str:
    """What submitit logged in the element so far (INFO on stdout, warnings on stderr)."""
    paths = (job.paths.stdout, job.paths.stderr)
    return "".join(path.read_text() for path in paths if path.exists())
