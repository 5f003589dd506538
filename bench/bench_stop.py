"""A container's stop while another user writes to the node's disk, side by side in one run,
the variants interleaved round by round.

Variants, on one image (bench_environment.py's, or `--sif`), each container having written
50 MB and removed a folder of the image before its stop (`stop(delete=True)`, timed):
  synced    ours as it was: the root's overlay without `volatile`, whose unmount syncs the
            whole filesystem its upper is on (the node's scratch disk)
  volatile  ours now (holder.py OVERLAY_OPTIONS)
each on an idle disk, then beside a writer (another process writing and removing files of
1.5 GB on the same disk, as a neighbour's job does).

Goal: volatile beside a writer <= 0.5x synced; no slower than synced on an idle disk.

Usage: uv run python bench/bench_stop.py [--rounds 5] [--sif SIF]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_environment import add_image_arguments, make_environment, server_sif

from harbor_hpc.containers import holder
from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.core.scratch import remove_private_dir

VARIANTS = {"synced": "userxattr", "volatile": holder.OVERLAY_OPTIONS}
WRITES = "head -c 50000000 /dev/urandom > /root/written && rm -rf /usr/share/doc"
WRITER = "while :; do head -c 1500000000 /dev/zero > {file}; rm -f {file}; done"


async def stop_time(sif: Path, folder: Path, options: str) -> float:
    holder.OVERLAY_OPTIONS = options
    trial = Path(tempfile.mkdtemp(dir=folder)) / "trial"
    environment = make_environment(
        SingularityEnvironment, sif, trial, "stop", 512, scratch_dir=folder / "scratch"
    )
    await environment.start(force_build=False)
    done = await environment.exec(WRITES)
    assert done.return_code == 0, done.stderr
    started = time.monotonic()
    await environment.stop(delete=True)
    return time.monotonic() - started


async def measure(sif: Path, folder: Path, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, options in VARIANTS.items():
            times[name].append(await stop_time(sif, folder, options))
    return times


def report(disk: str, times: dict[str, list[float]]) -> None:
    anchor = statistics.median(times["synced"])
    for name, values in times.items():
        p50 = statistics.median(values)
        print(
            f"{disk:14s} {name:9s} stop p50 {p50:.3f} s  worst {max(values):.3f} s  "
            f"{p50 / anchor:.2f}x synced"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    add_image_arguments(parser)
    args = parser.parse_args()
    sif = server_sif(args)
    if sif is None:
        return 2
    folder = Path(tempfile.mkdtemp(prefix="harbor-hpc-bench-stop-"))
    try:
        report("idle disk", asyncio.run(measure(sif, folder, args.rounds)))
        script = WRITER.format(file=folder / "neighbour")
        writer = subprocess.Popen(["sh", "-c", script], start_new_session=True)
        try:
            report("beside writer", asyncio.run(measure(sif, folder, args.rounds)))
        finally:
            os.killpg(writer.pid, signal.SIGKILL)
            writer.wait()
    finally:
        remove_private_dir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
