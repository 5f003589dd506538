"""How long a batch deadline takes to land: `run_rollouts(deadline_s=D)` over trials that would
run for ten minutes, from the deadline until the call returned (every trial ended, the run's
status final), with the box loaded or not, in one run.

Each round runs `--tasks` tasks that sleep 600 s with the oracle agent on local processes,
`--tasks` at a time, on bench_fleet's image, with a deadline of `--deadline` s; the figure is
the call's wall time less the deadline. With `--load K`, K busy processes of ours (a loop each)
keep the cores busy for the whole round, as a trainer's node is. The rounds alternate: one
unloaded, one loaded. Every trial must end cancelled, else the figure means nothing.

Usage: uv run python bench/bench_deadline.py [--tasks 4] [--deadline 20] [--rounds 3] [--load 4]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench_environment import add_image_arguments, server_sif

from harbor_hpc.api import RolloutRequest, run_rollouts, run_status
from tests.support.sample_tasks import make_task


def spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def load(processes: int) -> Iterator[None]:
    """`processes` busy loops of ours for as long as the block runs."""
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.join()


def landing(tasks: Path, run_dir: Path, count: int, deadline: float) -> float:
    """Seconds from the deadline until run_rollouts returned."""
    began = time.perf_counter()
    run_rollouts(
        RolloutRequest(
            tasks=tasks, run_dir=run_dir, agent="oracle", concurrency=count, deadline_s=deadline
        )
    )
    landed = time.perf_counter() - began - deadline
    states = [attempt.state.value for attempt in run_status(run_dir).attempts]
    if any(state in ("running", "pending", "done") for state in states):
        sys.exit(f"not every trial ended by the deadline's cancel: {states}")
    return landed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3, help="of each kind, unloaded and loaded")
    parser.add_argument("--load", type=int, default=4, help="busy processes in a loaded round")
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    sif = args.sif or server_sif(args)
    if sif is None:
        return 2
    figures: dict[str, list[float]] = {"unloaded": [], "loaded": []}
    with tempfile.TemporaryDirectory(prefix="bench-deadline-") as scratch:
        tasks = Path(scratch) / "tasks"
        for index in range(args.tasks):
            make_task(tasks, f"slow-{index}", kind="slow", image=str(sif), agent_timeout_sec=900)
        for round_ in range(args.rounds):
            for kind, busy in (("unloaded", 0), ("loaded", args.load)):
                with load(busy):
                    landed = landing(tasks, Path(scratch) / f"{kind}-{round_}", args.tasks,
                                     args.deadline)  # fmt: skip
                    load_average = os.getloadavg()[0]
                figures[kind].append(landed)
                print(f"  {kind:9} round {round_}: landed {landed:5.1f} s after the deadline "
                      f"(load average {load_average:.1f})", flush=True)  # fmt: skip
    print(f"\n{'':26}{'unloaded':>10}{'loaded':>10}")
    for key, pick in (("median s", statistics.median), ("max s", max)):
        print(f"  {key:24}{pick(figures['unloaded']):10.1f}{pick(figures['loaded']):10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
