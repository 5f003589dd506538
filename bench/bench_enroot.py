"""enroot as the runtime (issue 57), side by side in one run: `enroot start` alone, ours on
enroot (runtime=enroot) and ours on Apptainer (runtime=apptainer), on the same image.

enroot alone is what a user of an enroot cluster would run: the image's squashfs cut out of the
.sif (`dd`, once, not timed) and `enroot start --root --rw IMAGE.sqsh true` (enroot mounts it
through squashfuse and fuse-overlayfs each time; `enroot create` first would unpack it once, and
one created root starts one container at a time: its lock), in folders of the user's. Its exec is
`enroot exec PID true` into a container started with `sleep`. Ours: a start to the first
exec's answer, every fidelity feature on (root, a network of its own, the watchdog, the disk-
backed root), and exec round trips of `true` (p50). Then a fleet: FLEET starts at once of each,
all ready. Rounds interleave the variants (the machine is shared and noisy).

Needs enroot on PATH (.ci/provision.sh builds it into /opt/harbor-hpc-ci/enroot/bin) and a .sif.

Usage: uv run python bench/bench_enroot.py --sif SIF [--rounds 5] [--execs 200] [--fleet 64]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_environment import make_environment

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.sif import root_partition
from harbor_hpc.core.scratch import remove_private_dir
from harbor_hpc.runtimes.enroot import find_enroot


def enroot_env(folder: Path) -> dict[str, str]:
    """enroot's folders, the user's own (as its docs have a user set them)."""
    paths = {name: folder / name.lower() for name in ("DATA", "RUNTIME", "CACHE", "CONFIG")}
    for path in paths.values():
        path.mkdir(parents=True, exist_ok=True)
    return {**os.environ, **{f"ENROOT_{name}_PATH": str(path) for name, path in paths.items()}}


def cut_sqsh(sif: Path, sqsh: Path) -> None:
    partition = root_partition(sif)
    assert partition is not None, f"{sif} has no squashfs root"
    with sif.open("rb") as source, sqsh.open("wb") as target:
        source.seek(partition.offset)
        shutil.copyfileobj(source, target, 1 << 20)


def enroot_start(sqsh: Path, env: dict[str, str]) -> float:
    began = time.perf_counter()
    subprocess.run(["enroot", "start", "--root", "--rw", str(sqsh), "true"], env=env, check=True)
    return time.perf_counter() - began


async def enroot_fleet(sqsh: Path, env: dict[str, str], count: int) -> float:
    began = time.perf_counter()
    processes = [
        await asyncio.create_subprocess_exec(
            "enroot", "start", "--root", "--rw", str(sqsh), "true", env=env
        )
        for _ in range(count)
    ]
    codes = [await process.wait() for process in processes]
    assert codes == [0] * count, codes
    return time.perf_counter() - began


def enroot_execs(sqsh: Path, env: dict[str, str], count: int) -> list[float]:
    """`enroot exec PID true` round trips into a running `enroot start` container."""
    running = subprocess.Popen(
        ["enroot", "start", "--root", "--rw", str(sqsh), "sleep", "600"],
        env=env,
        start_new_session=True,
    )
    try:
        pid = None
        deadline = time.monotonic() + 30
        while pid is None and time.monotonic() < deadline:
            listed = subprocess.run(
                ["enroot", "list", "-f"], env=env, capture_output=True, text=True
            ).stdout.split()
            pid = next((word for word in listed if word.isdigit()), None)
            time.sleep(0.1)
        assert pid is not None, "no running enroot container listed"
        times = []
        for _ in range(count):
            began = time.perf_counter()
            subprocess.run(["enroot", "exec", pid, "true"], env=env, check=True)
            times.append(time.perf_counter() - began)
        return times
    finally:
        os.killpg(running.pid, 9)
        running.wait()


async def ours(sif: Path, folder: Path, runtime: str, execs: int) -> tuple[float, list[float]]:
    folder.mkdir(parents=True)
    environment = make_environment(
        SingularityEnvironment, sif, folder / "trial", "bench", 2048, runtime=runtime,
        unpacked_roots=0,
    )  # fmt: skip
    began = time.perf_counter()
    await environment.start(force_build=False)
    await environment.exec("true")
    start = time.perf_counter() - began
    times = []
    for _ in range(execs):
        began = time.perf_counter()
        await environment.exec("true")
        times.append(time.perf_counter() - began)
    await environment.stop(delete=True)
    return start, times


async def ours_fleet(sif: Path, folder: Path, runtime: str, count: int) -> float:
    environments = []
    for number in range(count):
        (folder / str(number)).mkdir(parents=True)
        environments.append(
            make_environment(
                SingularityEnvironment,
                sif,
                folder / str(number) / "trial",
                f"b{number}",
                512,
                runtime=runtime,
                unpacked_roots=0,
            )
        )

    async def one(environment: SingularityEnvironment) -> None:
        await environment.start(force_build=False)
        await environment.exec("true")

    began = time.perf_counter()
    await asyncio.gather(*(one(environment) for environment in environments))
    took = time.perf_counter() - began
    await asyncio.gather(*(environment.stop(delete=True) for environment in environments))
    return took


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sif", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--fleet", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if find_enroot() is None:
        raise SystemExit("enroot is not on PATH")
    scratch = Path(tempfile.mkdtemp(prefix="bench-enroot-"))
    try:
        sqsh = scratch / "image.sqsh"
        cut_sqsh(args.sif, sqsh)
        env = enroot_env(scratch / "enroot")
        starts: dict[str, list[float]] = {
            "enroot alone": [],
            "ours, enroot": [],
            "ours, apptainer": [],
        }
        execs: dict[str, list[float]] = {name: [] for name in starts}
        for number in range(args.rounds):
            starts["enroot alone"].append(enroot_start(sqsh, env))
            for runtime in ("enroot", "apptainer"):
                start, times = await ours(
                    args.sif, scratch / f"{runtime}-{number}", runtime, args.execs
                )
                starts[f"ours, {runtime}"].append(start)
                execs[f"ours, {runtime}"] += times
        execs["enroot alone"] = enroot_execs(sqsh, env, args.execs)
        fleet = {
            "enroot alone": await enroot_fleet(sqsh, env, args.fleet),
            "ours, enroot": await ours_fleet(args.sif, scratch / "fleet-e", "enroot", args.fleet),
            "ours, apptainer": await ours_fleet(
                args.sif, scratch / "fleet-a", "apptainer", args.fleet
            ),
        }
        anchor_start = statistics.median(starts["enroot alone"])
        anchor_exec = p50(execs["enroot alone"])
        print(f"{'':18}{'start s':>9}{'x alone':>9}{'exec p50 ms':>13}{'x alone':>9}"
              f"{f'fleet {args.fleet} s':>12}{'x alone':>9}")  # fmt: skip
        for name in starts:
            start = statistics.median(starts[name])
            exec_ms = p50(execs[name])
            print(
                f"{name:18}{start:9.2f}{start / anchor_start:9.2f}{exec_ms:13.2f}"
                f"{exec_ms / anchor_exec:9.2f}{fleet[name]:12.1f}"
                f"{fleet[name] / fleet['enroot alone']:9.2f}"
            )
    finally:
        remove_private_dir(scratch)


if __name__ == "__main__":
    asyncio.run(main())
