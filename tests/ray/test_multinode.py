"""A Ray cluster over the three-node Slurm cluster (`MultiNode`: each node its own network, no
default route, its own hostname, its own /tmp): every Ray node advertises the address Slurm
knows its node by, and a driver places an environment on each node and runs commands in it,
both from inside the cluster's allocation (a step of its job on the first node) and from a
machine that runs none of its nodes (this one, on the nodes' bridge: Ray drivers need a raylet
of their own machine, which the environment then starts, with no resources)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import MultiNode
from tests.ray.test_environment import DRIVER, drive, lines
from tests.support.cli import cli, cli_json

pytestmark = [pytest.mark.multinode, pytest.mark.slurm, pytest.mark.ray, pytest.mark.apptainer]

NODES = {"10.77.0.11", "10.77.0.12", "10.77.0.13"}

# Each environment reserves both CPUs of a node: the three land on three nodes.
ON_EACH_NODE = """
async def main():
    environments = [make(f"e{i}", ray_cpus=2) for i in range(3)]
    await asyncio.gather(*(e.start(False) for e in environments))
    for environment in environments:
        done = await environment.exec("echo ok", timeout_sec=60)
        show(node=environment.node, out=done.stdout.strip())
    await asyncio.gather(*(e.stop(True) for e in environments))
"""


def test_ray_nodes_advertise_slurms_addresses_and_host_an_environment_each(
    multinode: MultiNode, multinode_sif: Path
) -> None:
    cluster_dir = multinode.work / "ray"
    up = cli_json(
        "ray", "up", "--nodes", "3", "--cpus-per-node", "2", "--partition", "multi", "--time", "30",
        "--wait-timeout", "240", "--cluster-dir", str(cluster_dir), env=multinode.env,
    )  # fmt: skip
    try:
        assert up["address"].split(":")[0] in NODES
        status = cli_json("ray", "status", "--cluster-dir", str(cluster_dir), env=multinode.env)
        assert {node["ip"] for node in status["ray_nodes"]} == NODES
        script = DRIVER + ON_EACH_NODE + "\nasyncio.run(main())\n"
        driver = subprocess.Popen(
            ["srun", f"--jobid={up['job_id']}", "--overlap", "-N1", "-n1", "-w", "n1",
             sys.executable, "-c", script,
             str(multinode_sif), str(multinode.work / "envs"), str(cluster_dir)],
            env=multinode.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        found = lines(driver, timeout=400)
        assert sorted(line["out"] for line in found) == ["ok"] * 3
        assert {line["node"] for line in found} == NODES

        outside = drive(ON_EACH_NODE, multinode_sif, multinode.work / "outside", cluster_dir)
        found = lines(outside, timeout=400)
        assert sorted(line["out"] for line in found) == ["ok"] * 3
        assert {line["node"] for line in found} == NODES

        # The driver's own node held nothing, and ends with it (Ray hears of it within seconds).
        def alive() -> set[str]:
            status = cli_json("ray", "status", "--cluster-dir", str(cluster_dir), env=multinode.env)
            return {node["ip"] for node in status["ray_nodes"] if node["status"] != "DEAD"}

        deadline = time.monotonic() + 30
        while alive() != NODES and time.monotonic() < deadline:
            time.sleep(1)
        assert alive() == NODES
    finally:
        cli("ray", "down", "--cluster-dir", str(cluster_dir), env=multinode.env, check=False)
