"""Container start and exec, side by side in one run (issue 28): Apptainer alone, ours, Harbor's
Singularity environment and NeMo Gym's Apptainer sandbox, on the same .sif.

Start is to the first exec's answer (`true`), with every fidelity feature of ours on: fakeroot,
a network of its own, the disk-backed overlay, private /tmp, the memory watchdog. Apptainer alone
is `apptainer exec --fakeroot --contain --ipc --pid --net --network none SIF true`, and the
breakdown rows add to it what our container adds (the overlay, the server's python3: through the
overlay, and as ours starts it, from the image's root mounted beside it). Then 16
starts at once (all ready; Apptainer's with the breakdown's last row too: on a small node they
are CPU-bound), exec round trips of `true` (p50, p99), and a bare `true` spawned in the
container (posix_spawn and wait, timed inside: the floor of any exec).

Ours three ways: from the .sif (the default), and with `unpacked_roots=auto` an image used once
(each start a node, to the roots, that has not seen it: a scratch folder of its own) and an
image reused (the same scratch folder: its second start unpacked it in the background, waited
for before the measured starts; the time that took is printed).

NeMo Gym is not a dependency: give `--nemo-python` a python of a venv with `nemo-gym` (e.g.
`uv venv V && VIRTUAL_ENV=V uv pip install nemo-gym`); its rows are left out without one.
Harbor's environment needs uvicorn and FastAPI in the image: the image is bench_environment.py's.

Goals: start <= 2x Apptainer alone; a reused image's <= 1.5x Apptainer alone, an image used once
no slower than from the .sif; 16 at once <= 1.5x one; exec p50 <= 0.5x Harbor's and <= bare
true + 1 ms.

Usage: uv run python bench/bench_start.py [--rounds 5] [--execs 300] [--nemo-python PY]
       [--without-harbor] [--sif SIF]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
from bench_environment import add_image_arguments, make_environment, server_sif, unpack_on_node
from harbor.environments.base import BaseEnvironment
from harbor.environments.singularity import SingularityEnvironment as HarborSingularity

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.sif import root_partition
from harbor_hpc.containers.watchdog import kill_processes
from harbor_hpc.core.scratch import remove_private_dir
from harbor_hpc.runtimes.apptainer import FUSE_HELPERS, find_apptainer

AT_ONCE = 16
# Ours from the .sif, and with unpacked_roots=auto an image used once and one reused.
FROM_SIF = "harbor-hpc (.sif)"
ONCE = "harbor-hpc auto, used once"
REUSED = "harbor-hpc auto, reused"
APPTAINER_FLAGS = ("--fakeroot", "--contain", "--ipc", "--pid", "--net", "--network", "none")
# A bare `true` spawned and waited for inside the container, timed there (ms per spawn, sorted).
BARE_TRUE = (
    "python3 -I -S -c 'import os, time\n"
    "t = []\n"
    "for _ in range({n}):\n"
    "    b = time.perf_counter()\n"
    '    os.waitpid(os.posix_spawn("/bin/true", ["true"], os.environ), 0)\n'
    "    t.append(time.perf_counter() - b)\n"
    'print(" ".join(str(x * 1000) for x in sorted(t)))\''
)
# Run by the python of a venv with nemo-gym: its Apptainer sandbox's start, execs and stop.
NEMO_GYM = """
import asyncio, json, sys, time
from nemo_gym.sandbox.api import AsyncSandbox
from nemo_gym.sandbox.providers.base import SandboxSpec

async def main(sif, rounds, execs, at_once):
    out = {"start": [], "exec": [], "stop": [], "at_once": 0.0}
    for _ in range(rounds):
        box = AsyncSandbox({"apptainer": {}}, SandboxSpec(image=sif))
        began = time.perf_counter()
        await box.start()
        await box.exec("true")
        out["start"].append(time.perf_counter() - began)
        for _ in range(execs):
            began = time.perf_counter()
            await box.exec("true")
            out["exec"].append(time.perf_counter() - began)
        began = time.perf_counter()
        await box.stop()
        out["stop"].append(time.perf_counter() - began)
    boxes = [AsyncSandbox({"apptainer": {}}, SandboxSpec(image=sif)) for _ in range(at_once)]

    async def ready(box):
        await box.start()
        await box.exec("true")

    began = time.perf_counter()
    await asyncio.gather(*(ready(box) for box in boxes))
    out["at_once"] = time.perf_counter() - began
    await asyncio.gather(*(box.stop() for box in boxes))
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""


def percentile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def apptainer_alone(sif: Path, rounds: int, extra: Sequence[str], command: Sequence[str]) -> float:
    """Median seconds of `apptainer exec APPTAINER_FLAGS EXTRA SIF COMMAND`."""
    times = []
    with tempfile.TemporaryDirectory(prefix="bench-start-") as scratch:
        for index in range(rounds):
            overlay = Path(scratch) / f"overlay-{index}"
            overlay.mkdir()
            argv = [find_apptainer(), "exec", *APPTAINER_FLAGS]
            argv += [arg.replace("OVERLAY", str(overlay)) for arg in extra]
            began = time.perf_counter()
            subprocess.run([*argv, str(sif), *command], check=True, capture_output=True)
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def apptainer_at_once(sif: Path, extra: Sequence[str], command: Sequence[str]) -> float:
    """Seconds until AT_ONCE `apptainer exec APPTAINER_FLAGS EXTRA SIF COMMAND` started
    together all ended."""
    with tempfile.TemporaryDirectory(prefix="bench-start-") as scratch:
        argvs = []
        for index in range(AT_ONCE):
            overlay = Path(scratch) / f"overlay-{index}"
            overlay.mkdir()
            argv = [find_apptainer(), "exec", *APPTAINER_FLAGS]
            argv += [arg.replace("OVERLAY", str(overlay)) for arg in extra]
            argvs.append([*argv, str(sif), *command])
        began = time.perf_counter()
        processes = [subprocess.Popen(argv, stdout=subprocess.DEVNULL) for argv in argvs]
        for process in processes:
            process.wait()
        return time.perf_counter() - began


def fuse_helpers() -> list[psutil.Process]:
    """This user's running FUSE helpers of Apptainer."""
    return [
        process
        for process in psutil.process_iter(["name", "uids"])
        if process.info["name"] in FUSE_HELPERS and process.info["uids"].real == os.getuid()
    ]


Factory = Callable[[Path, str], BaseEnvironment]


async def ready(environment: BaseEnvironment) -> None:
    await environment.start(force_build=False)
    await environment.exec("true")


async def measure(factory: Factory, rounds: int, execs: int) -> dict[str, list[float]]:
    """Start (to the first exec's answer), exec round trips and stop of `rounds` environments;
    the bare `true` spawn times inside the first."""
    figures: dict[str, list[float]] = {"start": [], "exec": [], "stop": [], "bare": []}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as scratch:
        for index in range(rounds):
            environment = factory(Path(scratch) / f"trial-{index}", "bench")
            began = time.perf_counter()
            await ready(environment)
            figures["start"].append(time.perf_counter() - began)
            for _ in range(execs):
                began = time.perf_counter()
                await environment.exec("true")
                figures["exec"].append(time.perf_counter() - began)
            if index == 0:
                result = await environment.exec(BARE_TRUE.format(n=execs))
                figures["bare"] = [float(ms) / 1000 for ms in (result.stdout or "").split()]
            began = time.perf_counter()
            await environment.stop(delete=True)
            figures["stop"].append(time.perf_counter() - began)
    return figures


async def at_once(factory: Factory) -> tuple[float, int]:
    """Seconds until AT_ONCE environments started together are all ready (or failed), and how
    many failed to start (Harbor's server gives up on a busy node); what they left running
    (Harbor's FUSE helpers) is killed."""
    with tempfile.TemporaryDirectory(prefix="bench-start-") as scratch:
        environments = [factory(Path(scratch) / f"trial-{i}", "bench") for i in range(AT_ONCE)]
        before = {process.pid for process in fuse_helpers()}
        began = time.perf_counter()
        outcomes = await asyncio.gather(*(ready(e) for e in environments), return_exceptions=True)
        seconds = time.perf_counter() - began
        await asyncio.gather(*(e.stop(delete=True) for e in environments), return_exceptions=True)
        kill_processes([p for p in fuse_helpers() if p.pid not in before])
        return seconds, sum(isinstance(outcome, BaseException) for outcome in outcomes)


def nemo_gym(python: str | None, sif: Path, rounds: int, execs: int) -> dict[str, Any]:
    """NeMo Gym's figures from its venv's `python`, or {} (said why)."""
    if not python:
        print("NeMo Gym: left out (no --nemo-python)")
        return {}
    ran = subprocess.run(
        [python, "-c", NEMO_GYM, str(sif), str(rounds), str(min(execs, 20)), str(AT_ONCE)],
        capture_output=True,
        text=True,
    )
    if ran.returncode != 0:
        print(f"NeMo Gym failed ({ran.returncode}):\n{ran.stderr[-3000:]}")
        return {}
    figures: dict[str, Any] = json.loads(ran.stdout.strip().splitlines()[-1])
    return figures


def factories(sif: Path, harbor_too: bool, roots: Path) -> dict[str, Factory]:
    def from_sif(folder: Path, name: str) -> BaseEnvironment:
        return make_environment(SingularityEnvironment, sif, folder, name, 4096)

    def once(folder: Path, name: str) -> BaseEnvironment:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir=folder))  # a node new to it
        return make_environment(
            SingularityEnvironment, sif, folder, name, 4096, scratch_dir=str(scratch),
            unpacked_roots="auto",
        )  # fmt: skip

    def reused(folder: Path, name: str) -> BaseEnvironment:
        return make_environment(
            SingularityEnvironment, sif, folder, name, 4096, scratch_dir=str(roots),
            unpacked_roots="auto",
        )  # fmt: skip

    def harbor(folder: Path, name: str) -> BaseEnvironment:
        return make_environment(HarborSingularity, sif, folder, name, 4096)

    chosen: dict[str, Factory] = {FROM_SIF: from_sif, ONCE: once, REUSED: reused}
    return {**chosen, "harbor": harbor} if harbor_too else chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--execs", type=int, default=300)
    parser.add_argument("--nemo-python", default=os.environ.get("NEMO_GYM_PYTHON"))
    parser.add_argument(
        "--without-harbor",
        action="store_true",
        help="leave Harbor's environment out (its 16 at once take minutes on a small node)",
    )
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sif = server_sif(args)
    if sif is None:
        return 2
    print(f"image: {sif}\n", flush=True)
    overlay = ("--overlay", "OVERLAY")
    server = ("python3", "-I", "-S", "-c", "pass")
    # Our server's python3 starts from the image's root mounted beside the overlay (container.py).
    partition = root_partition(sif)
    assert partition is not None, f"{sif}: no squashfs root partition"
    view = (*overlay, "--bind", f"{sif}:/.image-view:id={partition.id},image-src=/")
    viewed = ("/.image-view/usr/bin/python3", *server[1:])
    floor_label = "  + --overlay, view's python3"
    alone = {
        "apptainer alone (true)": apptainer_alone(sif, args.rounds, (), ["true"]),
        "  + --overlay": apptainer_alone(sif, args.rounds, overlay, ["true"]),
        "  + --overlay, python3 -I -S": apptainer_alone(sif, args.rounds, overlay, server),
        floor_label: apptainer_alone(sif, args.rounds, view, viewed),
    }
    alone_at_once = apptainer_at_once(sif, (), ["true"])
    # What our container adds to Apptainer at once too: on a small node, all of it is CPU.
    floor_at_once = apptainer_at_once(sif, view, viewed)
    results: dict[str, dict[str, list[float]]] = {}
    crowd: dict[str, tuple[float, int]] = {}
    roots = Path(tempfile.mkdtemp(prefix="bench-start-roots-"))
    made = factories(sif, not args.without_harbor, roots)
    with tempfile.TemporaryDirectory(prefix="bench-start-warm-") as warm:
        reuse = made[REUSED]
        unpack = asyncio.run(unpack_on_node(lambda n: reuse(Path(warm), f"warm{n}"), roots))
    for name, factory in made.items():
        print(f"measuring {name} ...", flush=True)
        results[name] = asyncio.run(measure(factory, args.rounds, args.execs))
        crowd[name] = asyncio.run(at_once(factory))
    print("measuring NeMo Gym ...", flush=True)
    nemo = nemo_gym(args.nemo_python, sif, args.rounds, args.execs)
    if nemo:
        results["nemo-gym"] = nemo
        crowd["nemo-gym"] = (float(nemo["at_once"]), 0)
    base = alone["apptainer alone (true)"]

    print(f"\nstart, median of {args.rounds} (to the first exec's answer), ms:")
    for label, seconds in alone.items():
        print(f"  {label:32}{seconds * 1000:9.1f}")
    for name, figures in results.items():
        start = statistics.median(figures["start"])
        print(f"  {name:32}{start * 1000:9.1f}   {start / base:5.2f}x apptainer alone")
    ours = statistics.median(results[FROM_SIF]["start"])
    floor = alone[floor_label]
    print(
        f"  {FROM_SIF} over Apptainer's own start with the same mounts and python3: "
        f"+{(ours - floor) * 1000:.0f} ms ({ours / floor:.2f}x)"
    )
    print(f"  goal: {FROM_SIF} <= 2x apptainer alone: {'ok' if ours <= 2 * base else 'MISSED'}")
    once = statistics.median(results[ONCE]["start"])
    print(
        f"  goal: {ONCE} no slower than {FROM_SIF}: {once / ours:.2f}x "
        f"({'ok' if once <= 1.05 * ours else 'MISSED'}: within 5%, the noise here)"
    )
    reused = statistics.median(results[REUSED]["start"])
    print(
        f"  goal: {REUSED} <= 1.5x apptainer alone: {reused / base:.2f}x "
        f"({'ok' if reused <= 1.5 * base else 'MISSED'}; its second start unpacked it in the "
        f"background, ready {unpack:.2f} s after the first began)"
    )

    print(f"\n{AT_ONCE} at once, all ready, s (ratio to one start):")
    print(f"  {'apptainer alone':32}{alone_at_once:9.2f}   {alone_at_once / base:5.1f}x")
    print(f"  {floor_label:32}{floor_at_once:9.2f}   {floor_at_once / floor:5.1f}x")
    for name, (seconds, failed) in crowd.items():
        one = statistics.median(results[name]["start"])
        failures = f"   {failed} of {AT_ONCE} failed to start" if failed else ""
        print(f"  {name:32}{seconds:9.2f}   {seconds / one:5.1f}x{failures}")
    met = crowd[FROM_SIF][0] <= 1.5 * ours and not crowd[FROM_SIF][1]
    print(f"  goal: {FROM_SIF} <= 1.5x one: {'ok' if met else 'MISSED'}")

    print("\nexec round trip of `true`, ms:       p50      p99     stop s")
    for name, figures in results.items():
        p50, p99 = percentile(figures["exec"], 0.5), percentile(figures["exec"], 0.99)
        stop = statistics.median(figures["stop"])
        print(f"  {name:32}{p50 * 1000:8.2f} {p99 * 1000:8.2f} {stop:10.2f}")
    bare = results[FROM_SIF]["bare"]
    bare50, bare99 = percentile(bare, 0.5), percentile(bare, 0.99)
    print(f"  {'bare true in the container':32}{bare50 * 1000:8.2f} {bare99 * 1000:8.2f}")
    ours50 = percentile(results[FROM_SIF]["exec"], 0.5)
    if "harbor" in results:
        theirs50 = percentile(results["harbor"]["exec"], 0.5)
        print(
            f"  ours/harbor p50 {ours50 / theirs50:.2f} (goal <= 0.5): "
            f"{'ok' if ours50 <= 0.5 * theirs50 else 'MISSED'}"
        )
    print(
        f"  ours - bare true {(ours50 - bare50) * 1000:.2f} ms (goal <= 1): "
        f"{'ok' if ours50 - bare50 <= 0.001 else 'MISSED'}"
    )
    remove_private_dir(roots)
    return 0


if __name__ == "__main__":
    sys.exit(main())
