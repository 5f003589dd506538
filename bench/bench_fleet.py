"""A trainer's fleet: many environments open at once in one process, ours against Harbor's own.

RL trainers keep one environment per rollout slot open in their process. For N environments
of each kind (all in this process, on the same .sif as bench_environment.py builds):

- ready: the time until all N, started together, answered a first `true` (Harbor's start
  at most `--harbor-concurrency` at a time: started all at once on a small machine, each
  waits for its turn at the processors longer than Harbor's 60 s health check allows, and
  the start fails);
- idle CPU: what this process and every container's process tree use while all N sit idle
  (`--idle-sec`, after a few seconds to settle), in % of a core per environment;
- tree PSS: the PSS of each container's whole process tree, idle, per environment;
- exec p50 and p90: the latency of `true` run in all N at once, `--rounds` times.

Goals (issue 12): idle CPU <= 0.1% of a core per environment, all ready in <= 0.25x Harbor's
time, tree PSS <= 0.5x Harbor's. `--harbor-sizes` leaves out fleets of Harbor's that a small
machine cannot hold.

Ours runs with its defaults, in a scratch folder of each fleet's own: a node new to the image
(the fleet's roots over the .sif's squashfs, unpacked in the background meanwhile: roots.py).
`--roots` measures ours a second time as an RL trainer's fleet on a reused image runs: the
image unpacked on the node before the fleet starts (two starts, then its root waited for).

Usage: uv run python bench/bench_fleet.py [--sizes 16,32,64] [--harbor-sizes 16,32,64]
           [--harbor-concurrency 8] [--idle-sec 10] [--rounds 5] [--cache-dir DIR]
           [--roots]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from bench_environment import (
    MB,
    add_image_arguments,
    make_environment,
    server_sif,
    tree_root,
    unpack_on_node,
)
from harbor.environments.base import BaseEnvironment
from harbor.environments.singularity import SingularityEnvironment as HarborSingularity

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.watchdog import (
    kill_processes,
    tree_processes,
    tree_pss_bytes,
    wait_gone,
)
from harbor_hpc.core.scratch import remove_private_dir

SETTLE_SEC = 3.0
FUSE_HELPERS = {"squashfuse", "squashfuse_ll", "fuse-overlayfs", "fuse2fs"}
# Each goal: at most this much, as a ratio to Harbor's figure or (idle CPU) absolute.
GOALS = {"ready s": (0.25, "x"), "idle CPU %/env": (0.1, "%"), "tree PSS MB/env": (0.5, "x")}
# Issue 41: hundreds per node, all ready within this many seconds of the first start.
READY_GOALS = {256: 30.0, 512: 90.0}


@dataclass
class Fleet:
    ready: float
    idle_cpu: float  # % of a core per environment
    tree_pss: float  # MB per environment
    exec_p50: float  # ms
    exec_p90: float  # ms
    watchdog_checks: float | None  # our watchdog's looks at each tree per minute, idle
    left: int  # processes still running after stop
    descriptors: float  # this process's open files per environment
    tasks: float  # the user's processes and threads per environment (RLIMIT_NPROC counts them)

    def row(self) -> dict[str, float]:
        return {
            "ready s": self.ready,
            "idle CPU %/env": self.idle_cpu,
            "tree PSS MB/env": self.tree_pss,
            "exec p50 ms": self.exec_p50,
            "exec p90 ms": self.exec_p90,
            "open files/env": self.descriptors,
            "tasks/env": self.tasks,
        }


def own_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads(processes: list[psutil.Process]) -> int:
    counted = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            counted += process.num_threads()
    return counted


def cpu_seconds(processes: list[psutil.Process]) -> dict[tuple[int, float], float]:
    """User and system CPU of each process still running, by (pid, start time)."""
    times = {}
    for process in processes:
        try:
            used = process.cpu_times()
            times[(process.pid, process.create_time())] = used.user + used.system
        except psutil.Error:
            continue
    return times


def roots(environment: BaseEnvironment) -> list[int]:
    """The roots of an environment's process trees: its container's, and for ours the holder's
    of its namespaces (holder.py: their first process and the FUSE daemons they hold)."""
    held = getattr(environment, "_holder", None)
    return [tree_root(environment), *([held.pid] if held is not None and held.pid else [])]


def trees(environments: list[BaseEnvironment]) -> list[psutil.Process]:
    """The process trees of the environments that run."""
    processes = []
    for environment in environments:
        with contextlib.suppress(RuntimeError):
            for root in roots(environment):
                processes += tree_processes(root)
    return processes


async def idle_cpu(environments: list[BaseEnvironment], seconds: float) -> float:
    """% of a core that this process and the containers' trees use per environment, idle."""
    processes = trees(environments)
    us = psutil.Process()
    # The trees are read outside the window of our own CPU: reading them is the bench's cost.
    trees_before = cpu_seconds(processes)
    us_before = cpu_seconds([us])
    began = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - began
    used = sum(cpu_seconds([us]).values()) - sum(us_before.values())
    trees_after = cpu_seconds(processes)
    used += sum(trees_after[key] - trees_before[key] for key in trees_after if key in trees_before)
    return used / elapsed * 100 / len(environments)


async def timed_exec(environment: BaseEnvironment) -> float:
    began = time.perf_counter()
    result = await environment.exec("true")
    if result.return_code != 0:
        raise RuntimeError(f"`true` exited with {result.return_code}: {result.stderr}")
    return time.perf_counter() - began


async def ready(environment: BaseEnvironment, turns: asyncio.Semaphore) -> None:
    async with turns:
        await environment.start(force_build=False)
    await timed_exec(environment)


def orphans(since: float) -> list[psutil.Process]:
    """FUSE helpers of this session started since `since` that no longer sit below this
    process: Harbor's start kills its server between attempts and leaves them running."""
    below = {process.pid for process in psutil.Process().children(recursive=True)}
    session = os.getsid(0)
    found = []
    for process in psutil.process_iter(["name", "create_time"]):
        with contextlib.suppress(psutil.Error, OSError):
            if (
                process.info["name"] in FUSE_HELPERS
                and process.info["create_time"] >= since
                and process.pid not in below
                and os.getsid(process.pid) == session
            ):
                found.append(process)
    return found


async def measure(
    cls: type[BaseEnvironment],
    sif: Path,
    size: int,
    idle_sec: float,
    rounds: int,
    concurrency: int | None = None,
    reused: bool = False,
) -> Fleet:
    since = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as scratch:
        # Ours with its roots in this fleet's scratch: a node new to the image, or (`reused`)
        # one that has unpacked it.
        kwargs = (
            {"scratch_dir": str(Path(scratch) / "scratch")} if cls is SingularityEnvironment else {}
        )
        if reused:
            await unpack_on_node(
                lambda n: make_environment(
                    SingularityEnvironment,
                    sif,
                    Path(scratch) / f"warm-{n}",
                    "fleet",
                    4096,
                    **kwargs,
                ),
                Path(scratch) / "scratch",
            )
        environments = [
            make_environment(cls, sif, Path(scratch) / f"trial-{index}", "fleet", 4096, **kwargs)
            for index in range(size)
        ]
        fds_before, threads_before = own_descriptors(), psutil.Process().num_threads()
        try:
            began = time.perf_counter()
            turns = asyncio.Semaphore(concurrency or size)
            await asyncio.gather(*(ready(environment, turns) for environment in environments))
            ready_sec = time.perf_counter() - began
            await asyncio.sleep(SETTLE_SEC)
            descriptors = (own_descriptors() - fds_before) / size
            tasks = (
                threads(trees(environments)) + psutil.Process().num_threads() - threads_before
            ) / size
            ours = [env for env in environments if isinstance(env, SingularityEnvironment)]
            watchdogs = [env._watchdog for env in ours if env._watchdog is not None]
            checks = sum(watchdog.checks for watchdog in watchdogs)
            cpu = await idle_cpu(environments, idle_sec)
            checks = sum(watchdog.checks for watchdog in watchdogs) - checks
            pss = (
                statistics.mean(
                    sum(tree_pss_bytes(root) for root in roots(env)) for env in environments
                )
                / MB
            )
            latencies = []
            for _ in range(rounds):
                latencies += await asyncio.gather(*(timed_exec(env) for env in environments))
        finally:
            tree = trees(environments)
            await asyncio.gather(
                *(environment.stop(delete=True) for environment in environments),
                return_exceptions=True,
            )
            left = wait_gone(tree, 2) + orphans(since)
            kill_processes(left)
            remove_private_dir(Path(scratch) / "scratch")  # roots hold the subuids' files
    latencies.sort()
    return Fleet(
        ready=ready_sec,
        idle_cpu=cpu,
        tree_pss=pss,
        exec_p50=latencies[len(latencies) // 2] * 1000,
        exec_p90=latencies[int(len(latencies) * 0.9)] * 1000,
        watchdog_checks=checks / len(watchdogs) / idle_sec * 60 if watchdogs else None,
        left=len(left),
        descriptors=descriptors,
        tasks=tasks,
    )


def print_fleet(size: int, ours: Fleet, theirs: Fleet | str, roots: Fleet | None) -> None:
    """Ours (the default), ours with unpacked roots where measured, and Harbor's; the ratio and
    the goals are the default's."""
    head = f"{'harbor-hpc':>12}" + (f"{'reused':>12}" if roots else "")
    print(f"\n{size} environments{'':4}{head}{'harbor':>12}{'ratio':>9}{'goal':>9}")
    theirs_row = theirs.row() if isinstance(theirs, Fleet) else {}
    roots_row = roots.row() if roots else {}
    for key, value in ours.row().items():
        line = f"  {key:18}{value:12.3f}"
        if roots:
            line += f"{roots_row[key]:12.3f}"
        ratio = None
        if key in theirs_row:
            ratio = value / theirs_row[key]
            line += f"{theirs_row[key]:12.3f}{ratio:9.2f}"
        else:
            line += f"{'-':>12}{'':9}"
        if key in GOALS:
            limit, unit = GOALS[key]
            measured = value if unit == "%" else ratio
            line += f"{f'<={limit}{unit}':>9}"
            if measured is not None:
                line += "  ok" if measured <= limit else "  MISSED"
        print(line)
    if size in READY_GOALS:
        for name, fleet_of in (("harbor-hpc", ours), ("reused", roots)):
            if fleet_of is not None:
                verdict = "ok" if fleet_of.ready <= READY_GOALS[size] else "MISSED"
                print(f"  {name}: all ready within {READY_GOALS[size]:.0f} s: {verdict}")
    if ours.watchdog_checks is not None:
        print(f"  our watchdog looked at each tree {ours.watchdog_checks:.1f} times a minute, idle")
    if isinstance(theirs, str):
        print(f"  harbor: {theirs}")
    for name, fleet in (("harbor-hpc", ours), ("reused", roots), ("harbor", theirs)):
        if isinstance(fleet, Fleet) and fleet.left:
            print(f"  {name} left {fleet.left} processes running after stop (killed by the bench)")


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=sizes, default=[16, 32, 64])
    parser.add_argument("--harbor-sizes", type=sizes, default=None, help="default: --sizes")
    parser.add_argument("--harbor-concurrency", type=int, default=8)
    parser.add_argument("--idle-sec", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--roots",
        action="store_true",
        help="ours on a reused image too (unpacked on the node before the fleet starts)",
    )
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    harbor_sizes = args.sizes if args.harbor_sizes is None else args.harbor_sizes
    logging.getLogger("bench").setLevel(logging.ERROR)
    sif = server_sif(args)
    if sif is None:
        return 2
    print(f"image: {sif}", flush=True)
    for size in args.sizes:
        print(f"\nmeasuring {size} of ours ...", flush=True)
        ours = asyncio.run(measure(SingularityEnvironment, sif, size, args.idle_sec, args.rounds))
        roots = None
        if args.roots:
            print(f"measuring {size} of ours on a reused image ...", flush=True)
            roots = asyncio.run(
                measure(
                    SingularityEnvironment,
                    sif,
                    size,
                    args.idle_sec,
                    args.rounds,
                    reused=True,
                )
            )
        theirs: Fleet | str = "not measured (--harbor-sizes)"
        if size in harbor_sizes:
            print(f"measuring {size} of Harbor's ...", flush=True)
            try:
                theirs = asyncio.run(
                    measure(
                        HarborSingularity,
                        sif,
                        size,
                        args.idle_sec,
                        args.rounds,
                        args.harbor_concurrency,
                    )
                )
            except Exception as exc:  # a fleet too big for the machine: say so, go on
                theirs = f"failed: {type(exc).__name__}: {exc}"
        print_fleet(size, ours, theirs, roots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
