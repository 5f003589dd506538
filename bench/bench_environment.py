"""Our Apptainer environment against Harbor's own, on the same .sif in the same run.

For each environment, `--rounds` times: start (to the first possible exec), `--execs`
round trips of `true` (p50, p90), the PSS of the container's whole process tree after it
sat idle for a second (what the environment itself costs the task's memory), and stop.
Then the memory watchdog's own cost: CPU per check of a tree of 50 processes.
bench_fleet.py measures many environments open at once in one process.

Harbor's environment needs uvicorn and FastAPI in the image (it would pip-install them at
start, which an offline node cannot), so the bench builds one image FROM the test base
image with both baked into /opt/harbor-server from the wheel folder $HARBOR_HPC_TEST_WHEELS,
converts it once into the .sif store, and runs both environments on that .sif.

Goals (issue 6): exec p50 <= 0.5x theirs, start <= 0.5x theirs, idle PSS <= 0.6x theirs.

Usage: uv run python bench/bench_environment.py [--rounds 3] [--execs 300] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harbor.environments.base import BaseEnvironment
from harbor.environments.singularity import SingularityEnvironment as HarborSingularity
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.store import ensure_sif
from harbor_hpc.containers.watchdog import (
    RECHECK_SEC,
    MemoryWatchdog,
    kill_processes,
    tree_processes,
    tree_pss_bytes,
    wait_gone,
)
from harbor_hpc.core.config import cache_dir as default_store

IMAGE = "harbor-hpc-bench/harbor-server:1"
# Harbor's environment starts Apptainer with `--pwd /app`, which must exist in the image.
DOCKERFILE = """\
FROM {base}
WORKDIR /app
COPY wheels /tmp/wheels
RUN python3 -m venv /opt/harbor-server \\
 && /opt/harbor-server/bin/pip install --no-index --find-links /tmp/wheels uvicorn fastapi \\
 && rm -rf /tmp/wheels
"""
MB = 1024 * 1024


def build_image(base: str, wheels: Path) -> None:
    """The base image with Harbor's server dependencies where its bootstrap looks for them."""
    import docker

    client = docker.from_env()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        dockerfile = DOCKERFILE.format(base=base).encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
        tar.add(wheels, arcname="wheels")
    context.seek(0)
    client.images.build(fileobj=context, custom_context=True, tag=IMAGE, rm=True)
    client.close()


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both benchmarks need to make the image they measure on."""
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--base", default=os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE"))
    parser.add_argument("--wheels", type=Path, default=os.environ.get("HARBOR_HPC_TEST_WHEELS"))
    parser.add_argument(
        "--sif",
        type=Path,
        default=None,
        help="a .sif of this image made before (a user without Docker cannot build it)",
    )


def server_sif(args: argparse.Namespace) -> Path | None:
    """Build the image both environments can run and its .sif (or take `--sif`); None (said
    why) without inputs."""
    if args.sif is not None:
        return Path(args.sif)
    if not args.base or not args.wheels:
        print("set HARBOR_HPC_TEST_BASE_IMAGE and HARBOR_HPC_TEST_WHEELS (or --base/--wheels)")
        return None
    cache_dir = default_store(args.cache_dir)
    print(f"building {IMAGE} and its .sif in {cache_dir} ...", flush=True)
    build_image(args.base, args.wheels)
    return ensure_sif(f"docker-daemon://{IMAGE}", cache_dir)


@dataclass
class Figures:
    start: list[float] = field(default_factory=list)
    execs: list[float] = field(default_factory=list)
    idle_pss: list[float] = field(default_factory=list)
    stop: list[float] = field(default_factory=list)
    left: list[int] = field(default_factory=list)  # processes still running after stop

    def row(self) -> dict[str, float]:
        execs = sorted(self.execs)
        return {
            "start s": statistics.median(self.start),
            "exec p50 ms": execs[len(execs) // 2] * 1000,
            "exec p90 ms": execs[int(len(execs) * 0.9)] * 1000,
            "idle PSS MB": statistics.median(self.idle_pss),
            "stop s": statistics.median(self.stop),
            "left running": max(self.left),
        }


def make_environment(
    cls: type[BaseEnvironment],
    sif: Path,
    folder: Path,
    name: str,
    memory_mb: int,
    **kwargs: Any,
) -> BaseEnvironment:
    """An environment of `cls` on `sif` for a trial in `folder` (its task folder shared),
    with `kwargs` (the environment kwargs of `cls`)."""
    environment_dir = folder.parent / "environment"
    environment_dir.mkdir(exist_ok=True)
    trial_paths = TrialPaths(folder)
    trial_paths.mkdir()
    return cls(
        environment_dir=environment_dir,
        environment_name=name,
        session_id=f"{name}-{folder.name}",
        trial_paths=trial_paths,
        # A memory limit, so that both run their memory watchdog as in a real trial.
        task_env_config=EnvironmentConfig(docker_image=str(sif), memory_mb=memory_mb),
        logger=logging.getLogger("bench"),
        **kwargs,
    )


async def unpack_on_node(make: Callable[[int], BaseEnvironment], scratch: Path) -> float:
    """Start the image twice in environments `make` gives (the second start unpacks it in the
    background, unpacked_roots auto), then wait for its root among the roots in `scratch`: the
    seconds until it is there."""
    began = time.perf_counter()
    for number in range(2):
        environment = make(number)
        await environment.start(force_build=False)
        await environment.stop(delete=True)
    roots = scratch / f"harbor-hpc-roots-{os.getuid()}"
    while not any(path.is_dir() and not path.name.startswith(".") for path in roots.iterdir()):
        assert time.perf_counter() - began < 600, f"no root in {roots} (see the log)"
        await asyncio.sleep(0.1)
    return time.perf_counter() - began


def tree_root(environment: BaseEnvironment) -> int:
    if isinstance(environment, SingularityEnvironment):
        pid = environment.process_pid
    else:
        process = environment._server_process
        pid = process.pid if process is not None else None
    if pid is None:
        raise RuntimeError("the environment has no running process")
    return pid


async def measure(cls: type[BaseEnvironment], sif: Path, rounds: int, execs: int) -> Figures:
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="bench-env-") as scratch:
        for index in range(rounds):
            environment = make_environment(
                cls, sif, Path(scratch) / f"trial-{index}", "bench", 4096
            )
            began = time.perf_counter()
            await environment.start(force_build=False)
            await environment.exec("true")
            figures.start.append(time.perf_counter() - began)
            for _ in range(execs):
                began = time.perf_counter()
                await environment.exec("true")
                figures.execs.append(time.perf_counter() - began)
            await asyncio.sleep(1.0)
            figures.idle_pss.append(tree_pss_bytes(tree_root(environment)) / MB)
            tree = tree_processes(tree_root(environment))
            began = time.perf_counter()
            await environment.stop(delete=True)
            figures.stop.append(time.perf_counter() - began)
            left = wait_gone(tree, 1)
            figures.left.append(len(left))
            kill_processes(left)
    return figures


# Writes 3 GB in 20 MB steps as fast as it can, then holds it for a while.
HOG = (
    'python3 -c \'import time\nchunks = []\nfor _ in range(150): chunks.append(b"x" * (20 << 20))'
    "\ntime.sleep(20)'"
)
HOG_LIMIT_MB = 512


async def memory_hog(cls: type[BaseEnvironment], sif: Path) -> str:
    """How far a fast writer gets past the kill threshold (95% of the limit) before the kill."""
    with tempfile.TemporaryDirectory(prefix="bench-hog-") as scratch:
        environment = make_environment(cls, sif, Path(scratch) / "trial", "bench-hog", HOG_LIMIT_MB)
        await environment.start(force_build=False)
        tree = tree_processes(tree_root(environment))
        began = time.perf_counter()
        try:
            await environment.exec(HOG, timeout_sec=60)
            outcome = "not killed"
        except Exception as exc:  # each environment reports the kill its own way
            numbers = re.findall(r"(\d+)\s*MB", str(exc))
            peak = f"peak {numbers[0]} MB" if numbers else f"{type(exc).__name__}: {exc}"
            outcome = f"{peak}, killed after {time.perf_counter() - began:.1f} s"
        finally:
            await environment.stop(delete=True)
            # Harbor's watchdog kills only the Apptainer process: its FUSE helpers live on.
            orphans = wait_gone(tree, 1)
            if orphans:
                outcome += f"; left {len(orphans)} processes running (killed by the bench)"
                kill_processes(orphans)
    return outcome


def watchdog_cost(processes: int = 50, checks: int = 200) -> tuple[float, float]:
    """CPU ms per check of a tree (the RSS pass, which runs once the node allocated as much as
    the tree's headroom or RECHECK_SEC passed, and the PSS pass it runs above the threshold)."""
    script = f"for i in $(seq {processes - 1}); do sleep 300 & done; wait"
    tree = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    try:
        time.sleep(1.0)
        watchdog = MemoryWatchdog(tree.pid, limit_bytes=1 << 50)
        began = time.process_time()
        for _ in range(checks):
            watchdog.check()
        rss_ms = (time.process_time() - began) / checks * 1000
        began = time.process_time()
        for _ in range(checks):
            tree_pss_bytes(tree.pid)
        pss_ms = (time.process_time() - began) / checks * 1000
    finally:
        os.killpg(tree.pid, 9)
        tree.wait()
    return rss_ms, pss_ms


def print_table(ours: dict[str, float], theirs: dict[str, float]) -> None:
    goals = {"start s": 0.5, "exec p50 ms": 0.5, "idle PSS MB": 0.6}
    print(f"{'':14}{'harbor-hpc':>12}{'harbor':>12}{'ratio':>9}{'goal':>8}")
    for key, value in ours.items():
        ratio = value / theirs[key] if theirs[key] else float("nan")
        goal = f"<={goals[key]}" if key in goals else ""
        verdict = "" if key not in goals else ("  ok" if ratio <= goals[key] else "  MISSED")
        print(f"{key:14}{value:12.3f}{theirs[key]:12.3f}{ratio:9.2f}{goal:>8}{verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--execs", type=int, default=300)
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    sif = server_sif(args)
    if sif is None:
        return 2
    print(f"image: {sif}\n", flush=True)

    results: dict[str, Any] = {}
    for name, cls in (("theirs", HarborSingularity), ("ours", SingularityEnvironment)):
        print(f"measuring {name} ({args.rounds} rounds) ...", flush=True)
        results[name] = asyncio.run(measure(cls, sif, args.rounds, args.execs)).row()
    print()
    print_table(results["ours"], results["theirs"])
    threshold = int(HOG_LIMIT_MB * 0.95)
    print(f"\na process writing 3 GB against memory_mb={HOG_LIMIT_MB} (kill at {threshold} MB):")
    for name, cls in (("harbor-hpc", SingularityEnvironment), ("harbor", HarborSingularity)):
        print(f"  {name:11} {asyncio.run(memory_hog(cls, sif))}", flush=True)
    rss_ms, pss_ms = watchdog_cost()
    print(
        f"\nmemory watchdog, tree of 50 processes: {rss_ms:.3f} ms CPU per check "
        f"(idle, every {RECHECK_SEC:.0f} s: {rss_ms / RECHECK_SEC / 10:.3f}% of a core); "
        f"{pss_ms:.3f} ms per PSS pass (only above the threshold)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
