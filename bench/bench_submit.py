"""Trials per minute: `harbor-hpc submit` on Slurm against `harbor run` with Harbor's own
Singularity environment, on the same tasks at the same concurrency, in one run.

Both run `--tasks` solvable tasks with the oracle agent on the same .sif: the test base image
with uvicorn and FastAPI baked in (Harbor's environment needs them; ours runs any image), built
by bench_environment's `build_image` from $HARBOR_HPC_TEST_WHEELS and converted once into the
.sif store. Ours goes through Slurm as array elements of `--tasks-per-job` tasks, `--concurrency`
trials at a time, timed from `submit` until every trial has ended (`--wait`), so queueing and
job start-up count against it. Harbor's runs in one process on this machine, `--concurrency`
trials at a time (`harbor run -n`). Both must solve every task, or the figures mean nothing.

Usage: uv run python bench/bench_submit.py [--tasks 12] [--concurrency 2] [--tasks-per-job 6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_environment import add_image_arguments, server_sif

from tests.support.sample_tasks import make_task

HARBOR_ENVIRONMENT = "harbor.environments.singularity:SingularityEnvironment"


def run(command: list[str]) -> float:
    """Run `command` to completion; its wall time in seconds."""
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - began
    if result.returncode != 0:
        sys.exit(f"{' '.join(command[:3])} failed:\n{result.stderr[-2000:]}")
    return elapsed


def ours(
    tasks: Path, work: Path, concurrency: int, tasks_per_job: int
) -> tuple[float, list[float]]:
    run_dir = work / "harbor-hpc-run"
    elapsed = run(
        [
            sys.executable, "-m", "harbor_hpc", "submit", str(tasks), "--agent", "oracle",
            "--executor", "slurm", "--run-dir", str(run_dir), "--concurrency", str(concurrency),
            "--tasks-per-job", str(tasks_per_job), "--wait", "--json",
        ]
    )  # fmt: skip
    status = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "status", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rewards = [s["reward"] for s in json.loads(status.stdout)]
    return elapsed, rewards


def theirs(tasks: Path, work: Path, concurrency: int) -> tuple[float, list[float | None]]:
    jobs_dir = work / "harbor-jobs"
    harbor = str(Path(sys.executable).with_name("harbor"))
    elapsed = run(
        [
            harbor, "run", "--path", str(tasks), "--agent", "oracle",
            "--env", HARBOR_ENVIRONMENT, "--n-concurrent", str(concurrency),
            "--jobs-dir", str(jobs_dir), "--yes", "--quiet",
        ]
    )  # fmt: skip
    rewards = []
    for result in jobs_dir.glob("*/*/result.json"):
        data = json.loads(result.read_text())
        rewards.append(((data.get("verifier_result") or {}).get("rewards") or {}).get("reward"))
    return elapsed, rewards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=12)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--tasks-per-job", type=int, default=6)
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    sif = server_sif(args)
    if sif is None:
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-submit-") as scratch:
        work = Path(scratch)
        tasks = work / "tasks"
        for index in range(args.tasks):
            make_task(tasks, f"task-{index:03d}", image=str(sif), agent_timeout_sec=60)
        n = args.tasks
        print(f"{n} oracle trials, concurrency {args.concurrency} ...", flush=True)
        our_sec, our_rewards = ours(tasks, work, args.concurrency, args.tasks_per_job)
        their_sec, their_rewards = theirs(tasks, work, args.concurrency)
    for name, rewards in (("harbor-hpc submit", our_rewards), ("harbor run", their_rewards)):
        if len(rewards) != n or any(reward != 1 for reward in rewards):
            print(f"{name}: not every trial solved its task ({rewards}); figures are void")
            return 1
    our_rate, their_rate = n / our_sec * 60, n / their_sec * 60
    for name, seconds, rate in (
        ("harbor-hpc submit (Slurm, our environment)", our_sec, our_rate),
        ("harbor run (Harbor's Singularity)", their_sec, their_rate),
    ):
        print(f"{name:44s} {seconds:6.1f} s  {rate:6.1f} trials/min")
    print(f"{'ratio (ours / theirs, trials per minute)':44s} {our_rate / their_rate:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
