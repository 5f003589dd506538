"""submitit against the real Slurm: arrays, MaxArraySize, and squeue as the only job oracle."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import submitit

from harbor_hpc.results.status import queued_slurm_jobs
from harbor_hpc.slurm.resources import max_array_size, partition_limits


def square(x: int) -> int:
    return x * x


@pytest.mark.slurm
def test_an_array_runs_and_leaves_the_queue(tmp_path: Path) -> None:
    assert max_array_size() > 1
    limits = partition_limits(None)
    assert limits is not None and limits.cpus >= 1
    executor = submitit.SlurmExecutor(folder=tmp_path / "%j")
    executor.update_parameters(time=2, mem="200M", cpus_per_task=1, array_parallelism=2)
    jobs = executor.map_array(square, [2, 3])
    ids = [job.job_id for job in jobs]
    assert ids[0].endswith("_0") and ids[1].endswith("_1")
    base = ids[0].split("_")[0]
    deadline = time.monotonic() + 120
    while queued_slurm_jobs([base]) and time.monotonic() < deadline:
        time.sleep(1)
    assert not queued_slurm_jobs([base])
    assert [job.result() for job in jobs] == [4, 9]
