"""Our executor against the real Slurm: arrays, MaxArraySize, and squeue as the only job oracle."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

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
