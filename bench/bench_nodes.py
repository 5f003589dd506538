"""The same run on one Slurm node and on three, side by side: trials per minute.

`--tasks` solvable tasks, the oracle agent, one trial each, submitted with `harbor-hpc submit
--wait` (array elements of `--tasks-per-job` tasks, `--concurrency` trials at a time) to the
one-node cluster and then to the three-node cluster .ci/provision.sh makes beside it
(SLURM_CONF=$HARBOR_HPC_TEST_MULTI_SLURM_CONF). Timed from submit until every trial ended.

The three nodes of that cluster are namespaces of this one machine: they share its processors
and memory. The figure is a scheduling test (arrays spread over nodes, node-local scratch,
nothing lost), not a speed-up; on a real cluster each node brings its own processors.

The tasks, the run folders and the .sif live in a folder every node sees
($HARBOR_HPC_TEST_SHARED_DIR). Both runs must solve every task, or the figures mean nothing.

Usage: uv run python bench/bench_nodes.py [--tasks 200] [--tasks-per-job 10] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.support.images import build_debian_sif
from tests.support.multinode import multinode_work
from tests.support.sample_tasks import make_task


def timed_run(tasks: Path, run_dir: Path, args: argparse.Namespace, env: dict[str, str]) -> float:
    """Wall seconds of one submit --wait; exits naming the run when a trial did not solve."""
    command = [
        sys.executable, "-m", "harbor_hpc", "submit", str(tasks), "--agent", "oracle",
        "--executor", "slurm", "--run-dir", str(run_dir), "--tasks-per-job",
        str(args.tasks_per_job), "--concurrency", str(args.concurrency), "--wait", "--json",
    ]  # fmt: skip
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    elapsed = time.perf_counter() - began
    status = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "status", str(run_dir), "--json"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    rewards = [s["reward"] for s in json.loads(status.stdout or "[]")]
    if done.returncode != 0 or rewards != [1.0] * args.tasks:
        sys.exit(f"the run in {run_dir} did not solve every task:\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--tasks-per-job", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=2)
    args = parser.parse_args()
    multi, work = multinode_work("bench-nodes-")
    try:
        sif = build_debian_sif(work, os.environ, background=False)
        tasks = work / "tasks"
        for i in range(args.tasks):
            make_task(tasks, f"t{i:04d}", image=str(sif))
        clusters = {
            "1 node (the one-node cluster)": dict(os.environ),
            "3 nodes (one machine's namespaces)": multi,
        }
        figures = {
            name: timed_run(tasks, work / f"run-{i}", args, env)
            for i, (name, env) in enumerate(clusters.items())
        }
        one = next(iter(figures.values()))
        print(f"{args.tasks} oracle trials, {args.tasks_per_job} a job, {args.concurrency} at once")
        for name, seconds in figures.items():
            per_minute = args.tasks / seconds * 60
            print(
                f"{name:36} {seconds:7.1f} s  {per_minute:6.1f} trials/min  {one / seconds:4.2f}x"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
