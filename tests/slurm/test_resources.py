"""Chunking and per-element sizing from the tasks' own declarations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.results.record import Unit
from harbor_hpc.slurm.cluster import NodeLimits, SlurmPlacement
from harbor_hpc.slurm.resources import Resources, chunked, element_resources, fit_to_node
from harbor_hpc.steps.submit.checks import (
    agent_class,
    default_agent_kwargs,
    image_problem,
    reference_check,
    takes_kwarg,
)
from harbor_hpc.steps.submit.launch import submit_run
from harbor_hpc.steps.submit.options import ROLLOUT_KWARG, SubmitOptions
from harbor_hpc.steps.submit.plan import plan_chunks
from harbor_hpc.tasks.discovery import discover_tasks
from tests.support.probe_agent import AGENT, ProbeAgent
from tests.support.sample_tasks import make_task


def test_chunked() -> None:
    assert chunked([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert chunked([], 3) == []


def test_elements_hold_k_tasks_with_all_their_attempts() -> None:
    units = [Unit(t, k) for t in "abc" for k in range(2)]
    chunks = plan_chunks(units, tasks_per_job=2)
    assert chunks == [units[:4], units[4:]]
    # Local runs: at most `local_processes` elements, all at once.
    assert len(plan_chunks(units, tasks_per_job=1, local_processes=1)) == 1
    assert len(plan_chunks(units, tasks_per_job=1, local_processes=2)) == 2


def test_resources_follow_the_tasks(tmp_path: Path) -> None:
    make_task(tmp_path, "small", image="/x.sif", memory_mb=256, agent_timeout_sec=30)
    make_task(tmp_path, "big", image="/x.sif", memory_mb=1024, agent_timeout_sec=300)
    tasks = discover_tasks(tmp_path).tasks
    one = element_resources(tasks, trials=1, concurrency=2)
    four = element_resources(tasks, trials=4, concurrency=2)
    assert one.cpus == 1 and four.cpus == 2
    assert four.mem_mb == 2 * 1024 + one.mem_mb - 1024
    assert four.time_min > one.time_min  # two waves of two
    assert fit_to_node(four, NodeLimits(cpus=1, mem_mb=1000)) == Resources(
        four.time_min, 1000, 1, worker_mb=four.worker_mb
    )


def test_gpu_types_become_the_partitions_name_for_them(tmp_path: Path) -> None:
    make_task(tmp_path, "gpu", image="/x.sif", gpus=1, gpu_types=["H100", "A100"])
    asked = element_resources(discover_tasks(tmp_path).tasks, trials=2, concurrency=2)
    assert (asked.gpus, asked.gpu_types) == (2, ("H100", "A100"))
    node = NodeLimits(cpus=8, mem_mb=64000, gpu_types=frozenset({"a100", "v100"}))
    assert fit_to_node(asked, node).gpu_types == ("a100",)
    with pytest.raises(
        InputError, match="GPUs of type H100 or A100; the partition's nodes offer v100"
    ):
        fit_to_node(asked, NodeLimits(8, 64000, frozenset({"v100"})))


def test_image_problems_name_the_task_file(tmp_path: Path) -> None:
    sif = tmp_path / "there.sif"
    sif.write_text("")
    make_task(tmp_path / "t", "ok", image=str(sif))
    make_task(tmp_path / "t", "gone", image=str(tmp_path / "gone.sif"))
    make_task(tmp_path / "t", "none", image=None)
    check = reference_check({})  # no task names a registry reference: never asked
    problems = {t.rel: image_problem(t, check) for t in discover_tasks(tmp_path / "t").tasks}
    assert problems["ok"] is None
    assert "does not exist" in str(problems["gone"])
    assert "no environment.docker_image" in str(problems["none"])


def test_sbatch_args() -> None:
    placement = SlurmPlacement(sbatch_args=("--constraint=a100", "exclusive", "mail-type=END"))
    assert placement.sbatch() == {
        "constraint": "a100",
        "exclusive": True,
        "mail_type": "END",
    }


def test_local_runs_default_to_one_process(tmp_path: Path) -> None:
    # Without --array-parallelism, the local executor used to start one process per task at once.
    sif = tmp_path / "there.sif"
    sif.write_text("")
    for name in ("a", "b", "c"):
        make_task(tmp_path / "t", name, image=str(sif))
    make_task(tmp_path / "t", "d", image=str(sif), memory_mb=16384)
    options = SubmitOptions(agent="oracle", executor="local")
    result = submit_run(tmp_path / "t", tmp_path / "run", options, dry_run=True)
    # Local processes take only a time limit: no group of their own for bigger tasks.
    assert len(result.units) == 4 and len(result.chunks) == 1 and len(result.groups) == 1
    options.array_parallelism = 2
    assert len(submit_run(tmp_path / "t", tmp_path / "run", options, dry_run=True).chunks) == 2


class PassesKwargsOn(ProbeAgent):
    """An agent of a user's that takes what its parent takes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


def test_tokens_are_collected_by_default_where_the_agent_can() -> None:
    on = {"api_base": "http://x", ROLLOUT_KWARG: True}
    for agent in ("terminus-2", AGENT):  # Harbor's own, and one named by import path
        assert default_agent_kwargs(agent_class(agent), {"api_base": "http://x"}) == on
    assert takes_kwarg(PassesKwargsOn, ROLLOUT_KWARG)
    off = {ROLLOUT_KWARG: False}  # `--agent-kwarg collect_rollout_details=false`
    assert default_agent_kwargs(agent_class("terminus-2"), off) == off
    assert default_agent_kwargs(agent_class("oracle"), {}) == {}  # no model, no tokens
