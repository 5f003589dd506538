"""A trainer's fleet on a Ray cluster beside the same fleet run locally, in one run.

A trainer on GPU nodes keeps its rollouts' environments on CPU nodes of a Ray cluster
(`RaySingularityEnvironment`). The bench starts a Ray cluster of its own with the real CLI
(`harbor-hpc ray up`: by default one Slurm node holding two Ray nodes of one CPU each, a
multi-node cluster on one machine). For each N it measures N local environments
(`SingularityEnvironment`, in this process); then it joins the cluster, as a trainer does
before opening environments, and measures N environments on it for each N. All run the .sif
bench_fleet.py uses:

- ready: the time until all N, started together, answered a first `true` (the Ray ones
  include the placement of each and, in the first fleet, the start of each node's host);
- exec p50 and p99: the latency of `true` run in all N at once, `--rounds` times; and p50
  "alone", one command at a time (the Ray hop's own cost, without the queue for processors
  that N commands at once make on a small machine, where the nodes share the driver's cores);
- Ray's own call: the same latencies for a call that does nothing (each environment's host
  answering `where`), N at once and alone: the part of the Ray environments' exec that is the
  Ray hop, which no environment can go below;
- driver idle CPU: the CPU of this process alone (not the containers', nor Ray's nodes')
  while all N sit idle (`--idle-sec`, after a few seconds to settle), in % of a core per
  environment; the fixed cost of being a Ray driver is also measured with no environment.

Each Ray environment reserves `--ray-cpus` CPUs and `--memory-mb` (the task's memory, which
both kinds' watchdogs also enforce) of its node, small enough for 256 on two 1-CPU nodes.
The Ray environments must spread over at least two Ray nodes; the bench says when not.

Goals (issue 15): exec p50 at most 2 ms over the local one's, all ready within 1.5x the
local time, driver idle CPU at most 0.05% of a core per environment (Ray).

Usage: uv run --extra ray python bench/bench_ray_fleet.py [--sizes 16,64,256] [--idle-sec 10]
           [--rounds 10] [--partition P] [--nodes 1] [--ray-nodes-per-node 2]
           [--cpus-per-node 1] [--ray-cpus 0.005] [--memory-mb 64] [--sif SIF | --cache-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from bench_environment import MB, add_image_arguments, make_environment, server_sif, tree_root
from bench_fleet import SETTLE_SEC, cpu_seconds, ready, sizes, timed_exec, trees
from harbor.environments.base import BaseEnvironment

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.watchdog import (
    kill_processes,
    tree_processes,
    tree_pss_bytes,
    wait_gone,
)
from harbor_hpc.ray.connect import connect
from harbor_hpc.ray.environment import RaySingularityEnvironment
from harbor_hpc.ray.host import EnvironmentHost

EXEC_P50_OVER_MS = 2.0
READY_RATIO = 1.5
DRIVER_CPU_PERCENT = 0.05
STOP_GRACE_SEC = 2.0


@dataclass
class Fleet:
    ready: float  # s
    exec_p50: float  # ms
    exec_p99: float  # ms
    exec_alone_p50: float  # ms, one command at a time
    call_p50: float | None  # ms, a Ray call doing nothing, N at once (None: local)
    call_alone_p50: float | None  # ms, the same one at a time
    driver_cpu: float  # % of a core per environment
    ray_nodes: int | None  # the Ray nodes the fleet ran on (None: local)
    left: int  # processes still running after stop
    pss: float  # MB per environment: its container's tree (and its share of its node's host)


def cli(*arguments: str) -> str:
    """`harbor-hpc ARGUMENTS` as a user runs it; its stdout (stderr passes through)."""
    command = [sys.executable, "-m", "harbor_hpc", *arguments]
    return subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout


@contextlib.contextmanager
def ray_cluster(args: argparse.Namespace, parent: Path | None = None) -> Iterator[Path]:
    """A Ray cluster of `harbor-hpc ray up` in a folder of its own (in `parent`, default the
    temporary folder: one the nodes share where each node has a /tmp of its own), ended
    afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-ray-", dir=parent) as scratch:
        cluster_dir = Path(scratch) / "cluster"
        options = [
            "--nodes", str(args.nodes), "--ray-nodes-per-node", str(args.ray_nodes_per_node),
            "--cpus-per-node", str(args.cpus_per_node), "--time", str(args.ray_minutes),
            "--cluster-dir", str(cluster_dir), "--json",
        ]  # fmt: skip
        if args.partition:
            options += ["--partition", args.partition]
        began = time.perf_counter()
        try:
            up = json.loads(cli("ray", "up", *options))
            print(
                f"Ray cluster {up['address']} (Slurm job {up['job_id']}, {up['nodes']} Ray "
                f"nodes) up in {time.perf_counter() - began:.1f} s",
                flush=True,
            )
            yield cluster_dir
        finally:
            if (cluster_dir / "cluster.json").exists():
                cli("ray", "down", "--cluster-dir", str(cluster_dir))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


async def driver_cpu(seconds: float) -> float:
    """% of a core this process uses over `seconds` of doing nothing itself."""
    us = [psutil.Process()]
    before = sum(cpu_seconds(us).values())
    began = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - began
    return (sum(cpu_seconds(us).values()) - before) / elapsed * 100


# Run in the hosts, through Ray (`__ray_call__`), on the containers' own nodes: pickled by
# value, as functions of a script (`__main__`) are, since the hosts cannot import the bench.


def host_processes(host: EnvironmentHost) -> list[tuple[int, float]]:
    """Every process of the host's containers, as (pid, start time)."""
    found = []
    for environment in host._environments.values():
        if environment.process_pid is not None:
            for process in tree_processes(environment.process_pid):
                with contextlib.suppress(psutil.Error):
                    found.append((process.pid, process.create_time()))
    return found


def host_pss(host: EnvironmentHost) -> tuple[int, int]:
    """(PSS bytes of the host's containers and of the host's own process, environments)."""
    import os  # in the host's process: pickled by value, as the bench's functions are

    from harbor_hpc.containers.watchdog import pss_bytes, tree_pss_bytes

    containers = sum(
        tree_pss_bytes(environment.process_pid)
        for environment in host._environments.values()
        if environment.process_pid is not None
    )
    return containers + pss_bytes(os.getpid()), len(host._environments)


def host_leftovers(host: EnvironmentHost, processes: list[tuple[int, float]]) -> int:
    """How many of `processes` still run STOP_GRACE_SEC after their stop (then killed)."""
    running = []
    for pid, started in processes:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if process.create_time() == started:
                running.append(process)
    left = wait_gone(running, STOP_GRACE_SEC)
    kill_processes(left)
    return len(left)


async def on_hosts(
    hosts: dict[str, Any], function: Any, per_node: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`function(host)`, or `function(host, per_node[node])`, in each host, by node id."""
    refs = {
        node: host.__ray_call__.remote(function, *([per_node[node]] if per_node else []))
        for node, host in hosts.items()
    }
    return {node: await asyncio.wrap_future(ref.future()) for node, ref in refs.items()}


async def timed_call(environment: RaySingularityEnvironment) -> float:
    """A Ray call to the environment's host that does nothing there: the Ray hop alone."""
    began = time.perf_counter()
    await asyncio.wrap_future(environment._host.where.remote().future())
    return time.perf_counter() - began


async def measure(
    sif: Path, size: int, idle_sec: float, rounds: int, memory_mb: int, **ray_kwargs: Any
) -> Fleet:
    """N environments: local ones, or with `ray_kwargs` ones on the Ray cluster."""
    kind: type[BaseEnvironment] = (
        RaySingularityEnvironment if ray_kwargs else SingularityEnvironment
    )
    with tempfile.TemporaryDirectory(prefix="bench-ray-fleet-") as scratch:
        environments = [
            make_environment(
                kind, sif, Path(scratch) / f"trial-{index}", "fleet", memory_mb, **ray_kwargs
            )
            for index in range(size)
        ]
        remote = [env for env in environments if isinstance(env, RaySingularityEnvironment)]
        try:
            began = time.perf_counter()
            turns = asyncio.Semaphore(size)  # all at once
            await asyncio.gather(*(ready(env, turns) for env in environments))
            ready_sec = time.perf_counter() - began
            await asyncio.sleep(SETTLE_SEC)
            cpu = await driver_cpu(idle_sec) / size
            latencies = []
            for _ in range(rounds):
                latencies += await asyncio.gather(*(timed_exec(env) for env in environments))
            # One at a time: what the hop itself costs, without the processors' queue.
            alone = [await timed_exec(env) for env in environments[:16] for _ in range(rounds)]
            calls = []
            for _ in range(rounds if remote else 0):
                calls += await asyncio.gather(*(timed_call(env) for env in remote))
            calls_alone = [await timed_call(env) for env in remote[:16] for _ in range(rounds)]
            if remote:
                hosts_pss = await on_hosts(
                    {env.node_id: env._host for env in remote if env.node_id and env._host},
                    host_pss,
                )
                pss = sum(b for b, _ in hosts_pss.values()) / max(
                    1, sum(n for _, n in hosts_pss.values())
                )
            else:
                pss = sum(tree_pss_bytes(tree_root(env)) for env in environments) / size
        finally:
            nodes = {env.node_id for env in remote if env.node_id is not None}
            hosts = {
                env.node_id: env._host
                for env in remote
                if env.node_id is not None and env._host is not None
            }
            local_tree = [] if remote else trees(environments)
            remote_tree = await on_hosts(hosts, host_processes)
            await asyncio.gather(
                *(environment.stop(delete=True) for environment in environments),
                return_exceptions=True,
            )
            left = wait_gone(local_tree, STOP_GRACE_SEC)
            kill_processes(left)
            remote_left = await on_hosts(hosts, host_leftovers, remote_tree)
    return Fleet(
        ready=ready_sec,
        exec_p50=percentile(latencies, 0.5) * 1000,
        exec_p99=percentile(latencies, 0.99) * 1000,
        exec_alone_p50=percentile(alone, 0.5) * 1000,
        call_p50=percentile(calls, 0.5) * 1000 if remote else None,
        call_alone_p50=percentile(calls_alone, 0.5) * 1000 if remote else None,
        driver_cpu=cpu,
        ray_nodes=len(nodes) if remote else None,
        left=len(left) + sum(remote_left.values()),
        pss=pss / MB,
    )


def print_fleet(size: int, local: Fleet, ray: Fleet | str, ray_nodes: int) -> None:
    print(f"\n{size} environments{'':10}{'local':>10}{'ray':>10}{'ray vs local':>14}{'goal':>10}")
    if isinstance(ray, str):
        print(f"  ready s{'':17}{local.ready:10.3f}   ray: {ray}")
        return
    rows: list[tuple[str, float, float, str, str, bool | None]] = [
        (
            "ready s", local.ready, ray.ready, f"{ray.ready / local.ready:.2f}x",
            f"<={READY_RATIO}x", ray.ready / local.ready <= READY_RATIO,
        ),
        (
            "exec p50 ms", local.exec_p50, ray.exec_p50,
            f"{ray.exec_p50 - local.exec_p50:+.2f} ms", f"<=+{EXEC_P50_OVER_MS:g} ms",
            ray.exec_p50 - local.exec_p50 <= EXEC_P50_OVER_MS,
        ),
        (
            "exec p50 alone ms", local.exec_alone_p50, ray.exec_alone_p50,
            f"{ray.exec_alone_p50 - local.exec_alone_p50:+.2f} ms", f"<=+{EXEC_P50_OVER_MS:g} ms",
            ray.exec_alone_p50 - local.exec_alone_p50 <= EXEC_P50_OVER_MS,
        ),
        (
            "exec p99 ms", local.exec_p99, ray.exec_p99,
            f"{ray.exec_p99 - local.exec_p99:+.2f} ms", "", None,
        ),
        ("PSS MB/env", local.pss, ray.pss, f"{ray.pss / local.pss:.2f}x", "", None),
        (
            "driver idle %/env", local.driver_cpu, ray.driver_cpu, "",
            f"<={DRIVER_CPU_PERCENT}", ray.driver_cpu <= DRIVER_CPU_PERCENT,
        ),
    ]  # fmt: skip
    for key, mine, theirs, versus, goal, met in rows:
        verdict = "" if met is None else ("  ok" if met else "  MISSED")
        print(f"  {key:22}{mine:10.3f}{theirs:10.3f}{versus:>14}{goal:>10}{verdict}")
    for key, call, exec_p50, local_p50 in (
        ("Ray no-op call p50 ms", ray.call_p50, ray.exec_p50, local.exec_p50),
        ("  alone ms", ray.call_alone_p50, ray.exec_alone_p50, local.exec_alone_p50),
    ):
        if call is not None:  # how much of the exec's excess over local is the Ray hop itself
            print(
                f"  {key:22}{'':10}{call:10.3f}   exec over local less this: "
                f"{exec_p50 - local_p50 - call:+.2f} ms"
            )
    spread = "" if (ray.ray_nodes or 0) >= 2 else "  MISSED: fewer than two"
    print(f"  the Ray environments ran on {ray.ray_nodes} of the {ray_nodes} Ray nodes{spread}")
    for name, fleet in (("local", local), ("ray", ray)):
        if fleet.left:
            print(f"  {name} left {fleet.left} processes running after stop (killed by the bench)")


def summary(fleet: Fleet) -> str:
    return (
        f"ready {fleet.ready:.2f} s, exec p50 {fleet.exec_p50:.2f} ms, "
        f"p99 {fleet.exec_p99:.2f} ms, driver idle {fleet.driver_cpu:.4f}%/env, "
        f"PSS {fleet.pss:.1f} MB/env"
    )


def measure_all(
    args: argparse.Namespace, sif: Path, cluster_dir: Path
) -> tuple[dict[int, Fleet], dict[int, Fleet | str]]:
    """Every fleet of `args.sizes`, local then on the Ray cluster in `cluster_dir`."""
    figures = (args.idle_sec, args.rounds, args.memory_mb)
    local: dict[int, Fleet] = {}
    ray: dict[int, Fleet | str] = {}
    # Every local fleet before this process joins Ray: Ray's threads in this process
    # would count in the local fleets' driver CPU.
    for size in args.sizes:
        print(f"measuring {size} local ...", flush=True)
        local[size] = asyncio.run(measure(sif, size, *figures))
        print(f"  {summary(local[size])}", flush=True)
    began = time.perf_counter()
    connect(None, cluster_dir)  # as a trainer's process has, before its environments
    print(f"joined the Ray cluster in {time.perf_counter() - began:.1f} s", flush=True)
    idle = asyncio.run(driver_cpu(args.idle_sec))
    print(f"this process as an idle Ray driver: {idle:.3f}% of a core", flush=True)
    for size in args.sizes:
        print(f"measuring {size} on Ray ...", flush=True)
        try:
            fleet = asyncio.run(
                measure(sif, size, *figures, ray_cluster_dir=cluster_dir, ray_cpus=args.ray_cpus)
            )
            ray[size] = fleet
            print(f"  {summary(fleet)}", flush=True)
        except Exception as exc:  # a fleet too big for the cluster: say so, go on
            ray[size] = f"failed: {type(exc).__name__}: {exc}"
            print(f"  {ray[size]}", flush=True)
    return local, ray


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=sizes, default=[16, 64, 256])
    parser.add_argument("--idle-sec", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--memory-mb", type=int, default=64)
    parser.add_argument("--ray-cpus", type=float, default=0.005)
    parser.add_argument("--partition", default=None, help="default: harbor-hpc's config")
    parser.add_argument("--nodes", type=int, default=1, help="Slurm nodes of the Ray cluster")
    parser.add_argument("--ray-nodes-per-node", type=int, default=2)
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--ray-minutes", type=int, default=60, help="the cluster's time limit")
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    sif = args.sif or server_sif(args)
    if sif is None:
        return 2
    print(f"image: {sif}", flush=True)
    try:
        with ray_cluster(args) as cluster_dir:
            local, ray = measure_all(args, sif, cluster_dir)
    except subprocess.CalledProcessError as exc:  # the CLI said why on stderr
        print(f"harbor-hpc {shlex.join(exc.cmd[3:5])} failed with exit code {exc.returncode}")
        return 1
    for size in args.sizes:
        print_fleet(size, local[size], ray[size], args.nodes * args.ray_nodes_per_node)
    return 0


if __name__ == "__main__":
    sys.exit(main())
