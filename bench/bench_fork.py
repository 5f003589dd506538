"""Forks of a live sandbox (issue 58), side by side in one run: a fork into 1, 8 and 32
children against one start of the image and against `cp -a` of the parent's upper (what a
fork copies, alone) and against as many fresh starts at once (what the children cost beyond the
copy, on the machine's cores), for uppers of 1 MB, 100 MB and 1 GB.

A fork is timed from the call to every child started (each answered its first command); one
start likewise (a fresh environment to its first command's answer); `cp -a` is the copy of the
upper into a folder of the same disk, in the parent's namespaces (where its owners can be
kept), as `snapshot` copies it. Rounds interleave the variants (the machine is shared and
noisy). The goal: 8 forks of a 100 MB upper ready within 1.5x one start plus the copy.

Usage: uv run python bench/bench_fork.py --sif SIF [--rounds 3] [--sizes 1,100,1000]
    [--forks 1,8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench_environment import make_environment

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.core.proc import run
from harbor_hpc.core.scratch import remove_private_dir


def environment(sif: Path, folder: Path, name: str, scratch: Path) -> SingularityEnvironment:
    made = make_environment(SingularityEnvironment, sif, folder, name, 1024, scratch_dir=scratch)
    assert isinstance(made, SingularityEnvironment)
    return made


async def one_start(sif: Path, folder: Path, scratch: Path) -> float:
    began = time.perf_counter()
    fresh = environment(sif, folder, "start", scratch)
    await fresh.start(force_build=False)
    try:
        await fresh.exec("true")
        return time.perf_counter() - began
    finally:
        await fresh.stop(delete=True)


async def starts(sif: Path, folder: Path, scratch: Path, count: int) -> float:
    """`count` fresh environments started at once, all answering: what the fork's children
    cost beyond the copy, on this machine's cores."""
    folder.mkdir(parents=True)
    began = time.perf_counter()
    fresh = [environment(sif, folder / str(k), "start", scratch) for k in range(count)]
    try:
        await asyncio.gather(*(env.start(force_build=False) for env in fresh))
        await asyncio.gather(*(env.exec("true") for env in fresh))
        return time.perf_counter() - began
    finally:
        await asyncio.gather(*(env.stop(delete=True) for env in fresh))


async def forks(parent: SingularityEnvironment, count: int) -> float:
    began = time.perf_counter()
    children = await parent.fork(count)
    try:
        await asyncio.gather(*(child.exec("true") for child in children))
        return time.perf_counter() - began
    finally:
        await asyncio.gather(*(child.stop(delete=True) for child in children))


def copy_alone(parent: SingularityEnvironment, scratch: Path) -> float:
    main = parent._main  # the bench reads what a fork copies, as the fork does
    assert main is not None and main.holder is not None
    target = Path(tempfile.mkdtemp(prefix="bench-copy-", dir=scratch))
    enter = main.holder.enter()
    began = time.perf_counter()
    done = run(
        [*enter, "cp", "-a", "--", f"{main.root_state / 'upper'}/.", f"{target}/"], timeout=1800
    )
    took = time.perf_counter() - began
    assert done.ok, done.why()
    remove_private_dir(target)
    return took


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sif", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="1,100,1000", help="upper sizes, MB")
    parser.add_argument("--forks", default="1,8,32", help="children per fork")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    counts = [int(count) for count in args.forks.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-fork-"))
    scratch = work / "scratch"
    scratch.mkdir()
    rows = []
    for size in sizes:
        parent = environment(args.sif, work / f"parent-{size}", "parent", scratch)
        await parent.start(force_build=False)
        try:
            # The episode's changes: ten files of a tenth each (incompressible).
            chunk = max(size * 1024 * 1024 // 10, 1)
            wrote = await parent.exec(
                f"mkdir -p /root/work && for i in $(seq 10); do head -c {chunk} /dev/urandom"
                " > /root/work/f$i; done",
                user="root",
            )
            assert wrote.return_code == 0, wrote
            times: dict[str, list[float]] = {}
            for round_number in range(args.rounds):
                folder = work / f"start-{size}-{round_number}"
                times.setdefault("one start", []).append(await one_start(args.sif, folder, scratch))
                times.setdefault("cp -a of the upper", []).append(
                    await asyncio.to_thread(copy_alone, parent, scratch)
                )
                for count in counts:
                    times.setdefault(f"fork into {count}", []).append(await forks(parent, count))
                    if count > 1:
                        took = await starts(args.sif, folder / f"at-once-{count}", scratch, count)
                        times.setdefault(f"{count} starts at once", []).append(took)
        finally:
            await parent.stop(delete=True)
        medians = {name: statistics.median(values) for name, values in times.items()}
        anchor = medians["one start"] + medians["cp -a of the upper"]
        for name, value in medians.items():
            rows.append((size, name, value, value / anchor))
    remove_private_dir(work)
    print(f"{'upper (MB)':>10} | {'':<20} | {'median (s)':>10} | x (one start + cp -a)")
    for size, name, value, ratio in rows:
        print(f"{size:>10} | {name:<20} | {value:>10.2f} | {ratio:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
