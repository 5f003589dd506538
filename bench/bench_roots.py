"""A container's root of our own (issue 49), side by side in one run, the variants interleaved
round by round (this machine's disk speed drifts tenfold within minutes).

Variants, on one image (bench_environment.py's, built with Docker and converted):
  apptainer   `apptainer exec IMAGE.sif true`: the anchor
  before      ours as it was by default: Apptainer's own overlay on the .sif (fuse-overlayfs over
              squashfuse), the path nodes that cannot take ours still take
  first use   ours, an image new to the node: the root over the .sif's squashfs (squashfuse_ll),
              a scratch folder new to it each time
  reused      ours, the image unpacked on the node (`unpacked_roots = "auto"`, warmed first)
Start is to the first exec's answer, with our server and the memory watchdog up (memory_mb set).
Then 16 starts at once (all ready), and writes inside the container, timed inside it: `dpkg -i`
and `dpkg -r` of a package of 300 files (a package built here: no network), and 1000 files of
1 KB written; the same commands in `docker run` of the same image.

Goals: reused <= 1.0x apptainer, first use <= 1.2x; dpkg and the 1000 files <= 1.2x Docker.

Usage: uv run python bench/bench_roots.py [--rounds 11] [--sif SIF]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_environment import (
    IMAGE,
    add_image_arguments,
    make_environment,
    server_sif,
    unpack_on_node,
)
from harbor.environments.base import BaseEnvironment

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.holder import give_up, root_path
from harbor_hpc.core.scratch import remove_private_dir
from harbor_hpc.runtimes.apptainer import find_apptainer

AT_ONCE = 16
PACKAGE = "harbor-hpc-bench-files"
# Each prints the nanoseconds its work took, timed inside the container.
DPKG = (
    "s=$(date +%s%N); dpkg -i /tmp/bench.deb >/dev/null && dpkg -r {package} >/dev/null"
    " && e=$(date +%s%N) && echo $((e - s))"
)
FILES = (
    "mkdir -p /root/many.$$ && s=$(date +%s%N); for i in $(seq 1000); do "
    "printf '%01024d' 0 > /root/many.$$/$i; done; e=$(date +%s%N); echo $((e - s))"
)
Factory = Callable[[Path], BaseEnvironment]


def make_package(folder: Path) -> Path:
    """A .deb of 300 files of 1 KB in /usr/share/PACKAGE (dpkg renames each into place)."""
    root = folder / "package"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {PACKAGE}\nVersion: 1.0\nArchitecture: all\nMaintainer: bench <b@b>\n"
        "Description: files for a benchmark\n"
    )
    share = root / "usr" / "share" / PACKAGE
    for number in range(30):
        sub = share / f"d{number}"
        sub.mkdir(parents=True)
        for index in range(10):
            (sub / f"f{index}").write_bytes(b"x" * 1024)
    deb = folder / "bench.deb"
    subprocess.run(["dpkg-deb", "--build", "-Zgzip", str(root), str(deb)], check=True,
                   capture_output=True)  # fmt: skip
    return deb


def factories(sif: Path, scratch: Path) -> dict[str, Factory]:
    before, reused = scratch / "before", scratch / "reused"
    before.mkdir()
    reused.mkdir()
    give_up(before, "bench: as before issue 49")

    def ours(folder: Path, scratch_dir: Path) -> BaseEnvironment:
        folder.mkdir(parents=True, exist_ok=True)
        return make_environment(
            SingularityEnvironment, sif, folder, "bench", 4096, scratch_dir=str(scratch_dir)
        )

    def first_use(folder: Path) -> BaseEnvironment:
        return ours(folder, Path(tempfile.mkdtemp(prefix="node-", dir=scratch)))

    return {
        "before": lambda folder: ours(folder, before),
        "first use": first_use,
        "reused": lambda folder: ours(folder, reused),
    }


async def one_round(factory: Factory, folder: Path, deb: Path) -> tuple[float, float, float]:
    """(start s, dpkg s, files s) of one environment."""
    environment = factory(folder)
    began = time.perf_counter()
    await environment.start(force_build=False)
    await environment.exec("true")
    start = time.perf_counter() - began
    await environment.upload_file(deb, "/tmp/bench.deb")
    dpkg = await environment.exec(DPKG.format(package=PACKAGE))
    files = await environment.exec(FILES)
    await environment.stop(delete=True)
    assert dpkg.return_code == 0 and files.return_code == 0, (dpkg, files)
    return start, int(dpkg.stdout or 0) / 1e9, int(files.stdout or 0) / 1e9


async def at_once(factory: Factory, folder: Path) -> float:
    environments = [factory(folder / f"crowd-{index}") for index in range(AT_ONCE)]
    began = time.perf_counter()

    async def ready(environment: BaseEnvironment) -> None:
        await environment.start(force_build=False)
        await environment.exec("true")

    await asyncio.gather(*(ready(environment) for environment in environments))
    seconds = time.perf_counter() - began
    await asyncio.gather(*(environment.stop(delete=True) for environment in environments))
    return seconds


def apptainer_alone(sif: Path) -> float:
    began = time.perf_counter()
    subprocess.run([find_apptainer(), "exec", str(sif), "true"], check=True, capture_output=True)
    return time.perf_counter() - began


def docker(deb: Path) -> tuple[float, float]:
    """(dpkg s, files s) in `docker run` of the same image, timed inside."""
    script = f"cp /deb/bench.deb /tmp/ && {DPKG.format(package=PACKAGE)} && {FILES}"
    ran = subprocess.run(
        ["docker", "run", "--rm", "-v", f"{deb.parent}:/deb:ro", IMAGE, "sh", "-c", script],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    dpkg, files = (int(line) / 1e9 for line in ran.stdout.split())
    return dpkg, files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sif = server_sif(args)
    if sif is None:
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="bench-roots-"))
    print(f"image: {sif}\nthis node: {root_path(scratch, subids=True).describe()}\n", flush=True)
    try:
        deb = make_package(scratch)
        made = factories(sif, scratch)
        reused = made["reused"]
        asyncio.run(unpack_on_node(lambda n: reused(scratch / f"warm-{n}"), scratch / "reused"))
        start: dict[str, list[float]] = {"apptainer": [], **{name: [] for name in made}}
        dpkg: dict[str, list[float]] = {"docker": [], **{name: [] for name in made}}
        files: dict[str, list[float]] = {"docker": [], **{name: [] for name in made}}
        for number in range(args.rounds):
            start["apptainer"].append(apptainer_alone(sif))
            names = list(made)
            for name in names[number % len(names) :] + names[: number % len(names)]:
                figures = asyncio.run(one_round(made[name], scratch / f"r{number}-{name}", deb))
                start[name].append(figures[0])
                dpkg[name].append(figures[1])
                files[name].append(figures[2])
            in_docker = docker(deb)
            dpkg["docker"].append(in_docker[0])
            files["docker"].append(in_docker[1])
        crowd = {name: asyncio.run(at_once(made[name], scratch / f"c-{name}")) for name in made}
    finally:
        remove_private_dir(scratch)
    anchor = statistics.median(start["apptainer"])
    print(f"start, median of {args.rounds}, ms (ratio to `apptainer exec IMAGE.sif true`):")
    for name, times in start.items():
        median = statistics.median(times)
        print(f"  {name:12}{median * 1000:8.1f}   {median / anchor:5.2f}x")
    for name, goal in (("reused", 1.0), ("first use", 1.2)):
        ratio = statistics.median(start[name]) / anchor
        print(f"  goal: {name} <= {goal}x: {ratio:.2f}x {'ok' if ratio <= goal else 'MISSED'}")
    print(f"\n{AT_ONCE} at once, all ready, s:")
    for name, seconds in crowd.items():
        print(f"  {name:12}{seconds:8.2f}")
    for label, table in (("dpkg -i and -r, 300 files", dpkg), ("1000 files of 1 KB", files)):
        base = statistics.median(table["docker"])
        print(f"\n{label}, median s (ratio to Docker's):")
        for name, times in table.items():
            median = statistics.median(times)
            print(f"  {name:12}{median:8.3f}   {median / base:5.2f}x")
        for name in ("first use", "reused"):
            ratio = statistics.median(table[name]) / base
            print(f"  goal: {name} <= 1.2x: {ratio:.2f}x {'ok' if ratio <= 1.2 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    if shutil.which("docker") is None:
        print("docker is needed for the writes' anchor")
        sys.exit(2)
    sys.exit(main())
