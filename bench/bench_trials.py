"""Trials per minute of 32 one-second oracle tasks, four at a time, locally and on Slurm, against
the floor (32 x 1 s / 4 slots = 8 s: 240 trials a minute at best), for each harbor-hpc given (a
checkout's `harbor-hpc`: this one, and one of an earlier commit for a before), interleaved.

Each task's solution sleeps a second and solves; every trial must score 1, or the figures mean
nothing. Locally: `submit --executor local` (one process, `--concurrency 4`); on Slurm: one array
element of all 32, four at a time, timed from `submit` until every trial ended (`--wait`), so
queueing and the job's start count against it.

Usage: uv run python bench/bench_trials.py [--cli PATH ...] [--rounds 1] [--sif SIF]
       (e.g. --cli .venv/bin/harbor-hpc --cli ../before/.venv/bin/harbor-hpc, after
       `git worktree add ../before COMMIT && (cd ../before && uv sync --frozen)`)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_environment import add_image_arguments, server_sif

from tests.support.sample_tasks import make_task

TASKS = 32
SLOTS = 4
FLOOR_PER_MIN = 60 * SLOTS  # trials a minute if each took its second and nothing else


def make_tasks(root: Path, sif: Path) -> Path:
    for number in range(TASKS):
        task = make_task(root, f"t{number:02d}", image=str(sif))
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\nsleep 1\necho 42 > /tmp/answer\n")
    return root


def one_run(cli: str, tasks: Path, executor: str, run_dir: Path) -> float:
    """Trials a minute of one `submit --wait` of every task."""
    began = time.perf_counter()
    subprocess.run(
        [cli, "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
         "--executor", executor, "--concurrency", str(SLOTS), "--tasks-per-job", str(TASKS),
         "--wait"],
        check=True, capture_output=True,
    )  # fmt: skip
    seconds = time.perf_counter() - began
    ran = subprocess.run(
        [cli, "status", str(run_dir), "--json"], check=True, capture_output=True, text=True
    )
    rewards = [trial["reward"] for trial in json.loads(ran.stdout)]
    assert rewards == [1.0] * TASKS, f"{cli} {executor}: rewards {rewards}"
    return TASKS / seconds * 60


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cli", action="append", default=None, help="a harbor-hpc to measure")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--executors", default="local,slurm")
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    sif = server_sif(args)
    if sif is None:
        return 2
    clis = args.cli or [str(Path(sys.executable).parent / "harbor-hpc")]
    executors = args.executors.split(",")
    per_minute: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-trials-", dir=Path.home()) as folder:
        tasks = make_tasks(Path(folder) / "tasks", sif)
        for number in range(args.rounds):
            for executor in executors:
                for cli in clis:
                    run_dir = Path(folder) / f"run-{number}-{executor}-{len(per_minute)}"
                    print(f"{cli} {executor} ...", flush=True)
                    figure = one_run(cli, tasks, executor, run_dir)
                    per_minute.setdefault((cli, executor), []).append(figure)
    print(f"\n{TASKS} one-second oracle trials, {SLOTS} at a time: trials a minute "
          f"(floor {FLOOR_PER_MIN:.0f}):")  # fmt: skip
    for (cli, executor), figures in per_minute.items():
        median = statistics.median(figures)
        print(
            f"  {executor:6} {cli:45} {median:6.1f}   {median / FLOOR_PER_MIN:5.2f} of the floor's"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
