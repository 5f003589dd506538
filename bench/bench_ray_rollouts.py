"""Trials per minute of a trainer's batch: `run_rollouts` on a Ray cluster beside the same
batch on local processes, in one run.

The figures docs/ray.md sizes a fleet with. Both run `--tasks` solvable tasks with the oracle
agent on the same .sif (bench_fleet's image), `--concurrency` at a time, through the one call a
trainer makes (`run_rollouts`, executor "local" then "ray"), timed from the call until it
returned every line. The Ray cluster is `harbor-hpc ray up`'s (bench_ray_fleet's options), each
environment reserving `--ray-cpus` and the task's memory. For each: trials per minute, and from
Harbor's own timings in each trial's result.json the start cost (environment setup, p50 and max)
and the trial's whole time (p50). Both must solve every task, or the figures mean nothing.

Usage: uv run --extra ray python bench/bench_ray_rollouts.py [--tasks 16] [--concurrency 4]
           [--ray-cpus 0.25] [--nodes 1] [--ray-nodes-per-node 2] [--cpus-per-node 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench_environment import add_image_arguments, server_sif
from bench_ray_fleet import ray_cluster

from harbor_hpc.api import RolloutRequest, run_rollouts
from tests.support.sample_tasks import make_task


@dataclass
class Batch:
    wall: float  # s, the call until every line
    solved: int
    setup_p50: float  # s, Harbor's environment_setup
    setup_max: float
    trial_p50: float  # s, a trial from its start to its end

    @property
    def per_minute(self) -> float:
        return self.solved / self.wall * 60


def seconds(timing: dict[str, Any] | None) -> float:
    if not timing or not timing.get("started_at") or not timing.get("finished_at"):
        return float("nan")
    began = datetime.fromisoformat(timing["started_at"])
    return (datetime.fromisoformat(timing["finished_at"]) - began).total_seconds()


def batch(tasks: Path, run_dir: Path, concurrency: int, **request: Any) -> Batch:
    began = time.perf_counter()
    lines = run_rollouts(
        RolloutRequest(
            tasks=tasks, run_dir=run_dir, agent="oracle", concurrency=concurrency, **request
        )
    )
    wall = time.perf_counter() - began
    results = [json.loads((Path(line["trial_dir"]) / "result.json").read_text()) for line in lines]
    setups = [seconds(result.get("environment_setup")) for result in results]
    trials = [seconds(result) for result in results]
    return Batch(
        wall=wall,
        solved=sum(line["reward"] == 1.0 for line in lines),
        setup_p50=statistics.median(setups),
        setup_max=max(setups),
        trial_p50=statistics.median(trials),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--ray-cpus", type=float, default=0.25)
    parser.add_argument("--partition", default=None, help="default: harbor-hpc's config")
    parser.add_argument("--nodes", type=int, default=1, help="Slurm nodes of the Ray cluster")
    parser.add_argument("--ray-nodes-per-node", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--ray-minutes", type=int, default=30, help="the cluster's time limit")
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    sif = args.sif or server_sif(args)
    if sif is None:
        return 2
    figures: dict[str, Batch] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ray-rollouts-") as scratch:
        tasks = Path(scratch) / "tasks"
        for index in range(args.tasks):
            make_task(tasks, f"task-{index:03d}", image=str(sif))
        print(f"{args.tasks} tasks on {sif}, {args.concurrency} at a time", flush=True)
        figures["local"] = batch(tasks, Path(scratch) / "local", args.concurrency)
        print(f"  local: {figures['local'].wall:.1f} s", flush=True)
        with ray_cluster(args) as cluster_dir:
            figures["ray"] = batch(
                tasks,
                Path(scratch) / "ray",
                args.concurrency,
                executor="ray",
                environment_kwargs={"ray_cluster_dir": cluster_dir, "ray_cpus": args.ray_cpus},
            )
        print(f"  ray: {figures['ray'].wall:.1f} s", flush=True)
    local, ray = figures["local"], figures["ray"]
    print(f"\n{'':24}{'local':>10}{'ray':>10}{'ray/local':>11}")
    for key, attribute in (
        ("trials per minute", "per_minute"),
        ("batch wall s", "wall"),
        ("start p50 s", "setup_p50"),
        ("start max s", "setup_max"),
        ("trial p50 s", "trial_p50"),
    ):
        mine, theirs = getattr(local, attribute), getattr(ray, attribute)
        print(f"  {key:22}{mine:10.2f}{theirs:10.2f}{theirs / mine:10.2f}x")
    unsolved = {
        name: args.tasks - fig.solved for name, fig in figures.items() if fig.solved < args.tasks
    }
    if unsolved:
        print(f"NOT every task solved ({unsolved}): the figures mean nothing")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
