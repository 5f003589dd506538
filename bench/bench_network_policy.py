"""What a task's network policy costs, side by side in one run on the same .sif: start (to the
first possible exec), a round trip of `true`, a TCP connection through the policy, and a switch
between phases, for the internet (the anchor), no network, and an allowlist (its proxy and
nftables). Connections go to the egress test host (.ci/provision.sh,
$HARBOR_HPC_TEST_EGRESS_HOST) through a name `extra_hosts` gives it.

Usage: uv run python bench/bench_network_policy.py SIF [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.containers.environment import SingularityEnvironment

HOST = os.environ.get("HARBOR_HPC_TEST_EGRESS_HOST", "10.79.0.2")
CONNECT = (
    'python3 -c \'import socket; c = socket.create_connection(("allowed.test", 80), timeout=30); '
    'c.sendall(b"GET / HTTP/1.1\\r\\nHost: allowed.test\\r\\n\\r\\n"); print(c.recv(20))\''
)
POLICIES = {
    "public": NetworkPolicy(),
    "no-network": NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
    "allowlist": NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["allowed.test"]),
}


async def measure(sif: Path, folder: Path, name: str, policy: NetworkPolicy) -> dict[str, float]:
    paths = TrialPaths(folder / "trial")
    paths.mkdir()
    # A verifier with the internet beside it: the environment must be able to switch.
    phases = [policy, NetworkPolicy()] if name != "public" else []
    environment = SingularityEnvironment(
        environment_dir=folder,
        environment_name=name,
        session_id=f"{name}__env",
        trial_paths=paths,
        task_env_config=EnvironmentConfig(docker_image=str(sif)),
        logger=logging.getLogger("bench"),
        network_policy=policy,
        phase_network_policies=phases,
        extra_hosts=f"allowed.test:{HOST}",
    )
    started = time.perf_counter()
    await environment.start(force_build=False)
    figures = {"start s": time.perf_counter() - started}
    try:
        execs = []
        for _ in range(50):
            began = time.perf_counter()
            await environment.exec("true")
            execs.append(time.perf_counter() - began)
        figures["exec p50 ms"] = statistics.median(execs) * 1000
        if name != "no-network":
            began = time.perf_counter()
            result = await environment.exec(CONNECT)
            assert "reached" in (result.stdout or ""), result
            figures["connect ms"] = (time.perf_counter() - began) * 1000
        if phases:
            began = time.perf_counter()
            await environment.set_network_policy(NetworkPolicy())
            figures["switch ms"] = (time.perf_counter() - began) * 1000
    finally:
        await environment.stop(delete=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sif", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in POLICIES}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for name, policy in POLICIES.items():  # interleaved: the machine's noise hits all
                folder = Path(scratch) / f"{name}-{round_}"
                folder.mkdir()
                rows[name].append(asyncio.run(measure(args.sif, folder, name, policy)))
    anchor = statistics.median(row["start s"] for row in rows["public"])
    print(f"{'policy':<12}{'start s':>9}{'vs public':>11}{'exec p50 ms':>13}"
          f"{'connect ms':>12}{'switch ms':>11}")  # fmt: skip
    for name, figures in rows.items():

        def median(key: str, figures: list[dict[str, float]] = figures) -> str:
            values = [row[key] for row in figures if key in row]
            return f"{statistics.median(values):.1f}" if values else "-"

        start = statistics.median(row["start s"] for row in figures)
        print(
            f"{name:<12}{start:>9.2f}{start / anchor:>10.2f}x{median('exec p50 ms'):>13}"
            f"{median('connect ms'):>12}{median('switch ms'):>11}"
        )


if __name__ == "__main__":
    main()
