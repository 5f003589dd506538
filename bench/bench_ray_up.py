"""`ray up` many times in a row on the three-node cluster: how often it forms, how long it takes.

Each round is `harbor-hpc ray up --nodes 3` on the multi-node cluster .ci/provision.sh makes
(SLURM_CONF=$HARBOR_HPC_TEST_MULTI_SLURM_CONF), a check that Ray counts all three nodes at
their Slurm addresses, then `ray down`. A round that fails prints `ray up`'s one-line reason
(which node, and why) and the next round goes on; the last line is the tally.

Usage: uv run --extra ray python bench/bench_ray_up.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.support.multinode import multinode_work


def harbor_hpc(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip


def one_round(cluster_dir: Path, env: dict[str, str]) -> tuple[float, str | None]:
    """Seconds `ray up` took, and why the round failed (None when the cluster formed whole)."""
    began = time.perf_counter()
    up = harbor_hpc(
        "ray", "up", "--nodes", "3", "--cpus-per-node", "2", "--partition", "multi",
        "--time", "10", "--wait-timeout", "300", "--cluster-dir", str(cluster_dir), "--json",
        env=env,
    )  # fmt: skip
    took = time.perf_counter() - began
    try:
        if up.returncode != 0:
            return took, up.stderr.strip().splitlines()[-2] if up.stderr.strip() else "no message"
        status = harbor_hpc("ray", "status", "--cluster-dir", str(cluster_dir), "--json", env=env)
        ips = {node["ip"] for node in json.loads(status.stdout)["ray_nodes"]}
        return took, None if len(ips) == 3 else f"Ray counts {sorted(ips)}"
    finally:
        harbor_hpc("ray", "down", "--cluster-dir", str(cluster_dir), env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    env, work = multinode_work("bench-ray-up-")
    times, failures = [], []
    try:
        for number in range(1, args.rounds + 1):
            took, failed = one_round(work / f"round-{number}", env)
            times.append(took)
            print(f"round {number:3}: {took:5.1f} s  {failed or 'formed, 3 nodes'}", flush=True)
            if failed:
                failures.append(failed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{args.rounds - len(failures)}/{args.rounds} formed; ray up p50 "
        f"{statistics.median(times):.1f} s, max {max(times):.1f} s"
    )


if __name__ == "__main__":
    main()
