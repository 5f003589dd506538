"""A Ray cluster over the three-node Slurm cluster (`MultiNode`: each node its own network, no
default route, its own hostname, its own /tmp): every Ray node advertises the address Slurm
knows its node by, and a driver places an environment on each node and runs commands in it,
both from inside the cluster's allocation (a step of its job on the first node) and from a
machine that runs none of its nodes (this one, on the nodes' bridge: Ray drivers need a raylet
of their own machine, which the environment then starts, with no resources). And nodes lost
under a fleet: one crashed, one cut off the network, then the head's; each comes back."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import MultiNode
from tests.ray.test_environment import DRIVER, drive, lines, next_line
from tests.support.cli import cli, cli_json

pytestmark = [pytest.mark.multinode, pytest.mark.slurm, pytest.mark.ray, pytest.mark.apptainer]

# Each node at the address Slurm knows it by (.ci/slurm-multi.conf.in).
ADDRESS = {"n1": "10.77.0.11", "n2": "10.77.0.12", "n3": "10.77.0.13"}
NODES = set(ADDRESS.values())


def ray_status(cluster: MultiNode, cluster_dir: Path) -> dict[str, Any]:
    status: dict[str, Any] = cli_json(
        "ray", "status", "--cluster-dir", str(cluster_dir), env=cluster.env
    )
    return status


def ray_dirs(folder: Path) -> set[str]:
    """This user's Ray nodes' private folders in a node's /tmp."""
    return {p.name for p in folder.glob("harbor-hpc-ray-*") if p.lstat().st_uid == os.getuid()}


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
    before = {node: ray_dirs(tmp) for node, tmp in multinode.node_tmp.items()}
    up = cli_json(
        "ray", "up", "--nodes", "3", "--cpus-per-node", "2", "--partition", "multi", "--time", "30",
        "--wait-timeout", "240", "--cluster-dir", str(cluster_dir), env=multinode.env,
    )  # fmt: skip
    try:
        assert up["address"].split(":")[0] in NODES
        status = ray_status(multinode, cluster_dir)
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
            status = ray_status(multinode, cluster_dir)
            return {node["ip"] for node in status["ray_nodes"] if node["status"] != "DEAD"}

        deadline = time.monotonic() + 30
        while alive() != NODES and time.monotonic() < deadline:
            time.sleep(1)
        assert alive() == NODES
    finally:
        cli("ray", "down", "--cluster-dir", str(cluster_dir), env=multinode.env, check=False)
    # Every node's Ray files were in a folder of its own on its own /tmp, gone with the job
    # (within KillWait, 30 s, of `ray down`).
    deadline = time.monotonic() + 60
    while any(
        (left := {n: ray_dirs(t) - before[n] for n, t in multinode.node_tmp.items()}).values()
    ):
        assert time.monotonic() < deadline, left
        time.sleep(1)


# One environment on each node; after the test's faults, a command in each, concurrently.
FLEET = """
async def main():
    environments = [make(f"e{i}", ray_cpus=2) for i in range(3)]
    await asyncio.gather(*(e.start(False) for e in environments))
    show(nodes=[e.node for e in environments])
    sys.stdin.readline()  # the test breaks nodes meanwhile
    began = time.monotonic()

    async def run(environment):
        try:
            done = await environment.exec("echo ok", timeout_sec=30)
            show(node=environment.node, out=done.stdout.strip(), after=time.monotonic() - began)
        except Exception as error:
            show(node=environment.node, error=f"{type(error).__name__}: {error}",
                 after=time.monotonic() - began)

    await asyncio.gather(*(run(e) for e in environments))
    await asyncio.gather(*(e.stop(True) for e in environments))
    show(stopped=True)
"""


# Eight environments on each node (a quarter CPU each of a node's two), each running a short
# command that keeps a processor busy, again and again: the box loaded by the fleet itself.
# The test says when it killed a node ("killed": each counts its commands from then on) and
# when to stop.
BUSY_FLEET = """
PER_NODE = 8
BUSY = "timeout 0.5 sh -c 'while :; do :; done'; echo ok"

async def main():
    environments = [make(f"e{i}", memory_mb=128, ray_cpus=0.25) for i in range(3 * PER_NODE)]
    await asyncio.gather(*(e.start(False) for e in environments))
    show(nodes=[e.node for e in environments])
    done = {e.environment_name: 0 for e in environments}
    stop = asyncio.Event()

    async def keep_busy(environment):
        try:
            while not stop.is_set():
                result = await environment.exec(BUSY, timeout_sec=120)
                done[environment.environment_name] += result.stdout.strip() == "ok"
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    loops = [asyncio.create_task(keep_busy(e)) for e in environments]
    await asyncio.to_thread(sys.stdin.readline)  # "killed"
    at_kill = dict(done)
    await asyncio.to_thread(sys.stdin.readline)  # "stop"
    stop.set()
    errors = await asyncio.gather(*loops)
    show(results=[
        dict(node=e.node, after=done[e.environment_name] - at_kill[e.environment_name], error=error)
        for e, error in zip(environments, errors)
    ])
    await asyncio.gather(*(e.stop(True) for e in environments))
    show(stopped=True)
"""


def lose_a_node_under_a_busy_fleet(
    cluster: MultiNode, sif: Path, cluster_dir: Path, *, run_after_s: float = 25
) -> list[dict[str, Any]]:
    """24 environments, 8 a node, all running commands; n2 crashes; the fleet runs on for
    `run_after_s`: what each environment did after the crash (commands, or the error that
    ended it), once the driver stopped them all."""
    driver = drive(BUSY_FLEET, sif, cluster.work / "busy", cluster_dir)
    try:
        placed = next_line(driver)["nodes"]
        assert sorted(placed.count(ip) for ip in NODES) == [8, 8, 8], placed
        time.sleep(5)  # the fleet at work
        cluster.node("crash", "n2")
        assert driver.stdin is not None
        driver.stdin.write("killed\n")
        driver.stdin.flush()
        time.sleep(run_after_s)
        driver.stdin.write("stop\n")
        driver.stdin.flush()
        results: list[dict[str, Any]] = next_line(driver)["results"]
        assert next_line(driver) == {"stopped": True}
        driver.wait(timeout=120)
        return results
    finally:
        driver.kill()
        driver.communicate()


def only_the_lost_nodes_environments_ended(results: list[dict[str, Any]]) -> list[str]:
    """What went wrong, environment by environment: one on the lost node that did not end with
    its node named, one elsewhere that ended or did nothing after the crash."""
    wrong = []
    for number, result in enumerate(results):
        error = result["error"] or ""
        if result["node"] == ADDRESS["n2"]:
            if not error.startswith("EnvironmentHostUnavailable: task e"):
                wrong.append(f"e{number} on the lost node: {result}")
        elif error or result["after"] == 0:
            wrong.append(f"e{number} on {result['node']}: {result}")
    return wrong


def test_a_node_lost_under_a_busy_fleet_ends_only_its_own_environments(
    faulty_nodes: MultiNode, multinode_sif: Path
) -> None:
    cluster_dir = faulty_nodes.work / "ray"
    ray_up(faulty_nodes, cluster_dir)
    try:
        results = lose_a_node_under_a_busy_fleet(faulty_nodes, multinode_sif, cluster_dir)
    finally:
        cli("ray", "down", "--cluster-dir", str(cluster_dir), env=faulty_nodes.env, check=False)
    assert only_the_lost_nodes_environments_ended(results) == []


# Ray's health checks (which a Ray node inherits from `up`'s environment through the job):
# every 2 s, given up after 3 s, three missed in a row; a node cut off is found dead in some
# 15 s rather than Ray's minute (every 3 s, 10 s, five in a row).
HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "3",
}


def ray_up(cluster: MultiNode, cluster_dir: Path) -> dict[str, Any]:
    up: dict[str, Any] = cli_json(
        "ray", "up", "--nodes", "3", "--cpus-per-node", "2", "--partition", "multi", "--time", "30",
        "--wait-timeout", "240", "--cluster-dir", str(cluster_dir),
        env={**cluster.env, **HEALTH_CHECKS},
    )  # fmt: skip
    assert up["address"].startswith(ADDRESS["n1"] + ":")  # the head: Slurm's first node
    return up


def lose_two_nodes_under_a_fleet(
    cluster: MultiNode, sif: Path, cluster_dir: Path
) -> dict[str, dict[str, Any]]:
    """An environment on each node; n2 crashes and n3 is cut off; then a command in each: what
    each environment answered (by node address), once the driver stopped them all."""
    driver = drive(FLEET, sif, cluster.work / "envs", cluster_dir)
    try:
        assert sorted(next_line(driver)["nodes"]) == sorted(ADDRESS.values())
        cluster.node("crash", "n2")  # every process of it killed: Ray hears of it at once
        cluster.node("cut", "n3")  # its link down: silence, until Ray's health checks give up
        assert driver.stdin is not None
        driver.stdin.write("go\n")
        driver.stdin.flush()
        seen = {line["node"]: line for line in (next_line(driver) for _ in range(3))}
        assert next_line(driver) == {"stopped": True}
        driver.wait(timeout=60)
        return seen
    finally:
        driver.kill()
        driver.communicate()


def test_nodes_lost_under_a_fleet_end_only_their_environments_and_the_head_ends_the_cluster(
    faulty_nodes: MultiNode, multinode_sif: Path
) -> None:
    cluster = faulty_nodes
    cluster_dir = cluster.work / "ray"
    before = {node: ray_dirs(tmp) for node, tmp in cluster.node_tmp.items()}
    ray_up(cluster, cluster_dir)
    try:
        seen = lose_two_nodes_under_a_fleet(cluster, multinode_sif, cluster_dir)
        assert seen[ADDRESS["n1"]]["out"] == "ok", seen
        for lost in ("n2", "n3"):
            error = seen[ADDRESS[lost]]["error"]
            assert error.startswith("EnvironmentHostUnavailable: task e"), error
            assert f"its Ray node {ADDRESS[lost]} (node id" in error, error
        # A crash is news at once; silence takes Ray's health checks (HEALTH_CHECKS).
        assert seen[ADDRESS["n2"]]["after"] < 30, seen

        # The cluster goes on without them, and says so: the job runs, the two nodes are dead.
        def ray_states() -> dict[str, str]:
            status = ray_status(cluster, cluster_dir)
            assert status["job_state"] == "RUNNING", status
            # The driver's own node (on this machine) is left out: it ended with the driver.
            nodes = status["ray_nodes"]
            return {n["ip"]: n["status"] for n in nodes if n["ip"] in ADDRESS.values()}

        deadline = time.monotonic() + 120
        while ray_states() != {ADDRESS["n1"]: "IDLE", ADDRESS["n2"]: "DEAD", ADDRESS["n3"]: "DEAD"}:
            assert time.monotonic() < deadline, ray_states()
            time.sleep(2)

        # Both come back. What the cut-off node still ran of the job, Slurm ends when the node
        # registers again: once Slurm too found it silent (SlurmdTimeout) and took it out of
        # the job, which Ray's health checks may be quicker to do than Slurm.
        deadline = time.monotonic() + 60
        while not cluster.state("n3").startswith("down"):
            assert time.monotonic() < deadline, cluster.slurm("sinfo", "-N")
            time.sleep(1)
        cluster.node("heal", "n3")
        cluster.node("start", "n2")
        deadline = time.monotonic() + 150
        while cluster.node_pids_of_user("n3"):
            assert time.monotonic() < deadline, cluster.node_pids_of_user("n3")
            time.sleep(1)
        assert ray_states()[ADDRESS["n1"]] == "IDLE"

        # The head's node crashes: `ray status` says the cluster does not answer, then that its
        # job ended; `ray down` forgets it.
        cluster.node("crash", "n1")
        deadline = time.monotonic() + 120
        while (status := ray_status(cluster, cluster_dir))["job_state"] == "RUNNING":
            assert time.monotonic() < deadline, status
            unreachable = status["unreachable"]
            assert unreachable is None or "does not answer" in unreachable, unreachable
            time.sleep(2)
        assert (status["job_state"], status["ray_nodes"]) == (None, []), status
    finally:
        cli("ray", "down", "--cluster-dir", str(cluster_dir), env=cluster.env, check=False)
    assert not (cluster_dir / "cluster.json").exists()
    assert not cluster.slurm("squeue", "-h", "-u", str(os.getuid()), "-o", "%i").strip()

    # Every node back, a new cluster forms on all three: the first Ray node on each clears
    # what the killed ones left in its /tmp, and `ray down` leaves nothing there.
    cluster.restore()
    ray_up(cluster, cluster_dir)
    assert {n["ip"] for n in ray_status(cluster, cluster_dir)["ray_nodes"]} == set(ADDRESS.values())
    cli("ray", "down", "--cluster-dir", str(cluster_dir), env=cluster.env)
    deadline = time.monotonic() + 30
    while any((left := {n: ray_dirs(t) - before[n] for n, t in cluster.node_tmp.items()}).values()):
        assert time.monotonic() < deadline, left
        time.sleep(1)


def raylet_at(ip: str) -> psutil.Process:
    """This user's raylet of the node at `ip`."""
    for process in psutil.process_iter(["name", "cmdline", "uids"]):
        cmdline = process.info["cmdline"] or []
        if (
            process.info["name"] == "raylet"
            and process.info["uids"].real == os.getuid()
            and f"--node_ip_address={ip}" in cmdline
        ):
            return process
    raise AssertionError(f"no raylet at {ip}")


def stop_first_raylet_of(ip: str, deadline: float) -> psutil.Process:
    """Stop the first raylet of the node at `ip` as soon as it runs, before it registers: a node
    too slow for Ray's fixed 30 s start-up wait (a busy machine did this to `ray up`)."""
    while time.monotonic() < deadline:
        with contextlib.suppress(AssertionError, psutil.Error):
            raylet = raylet_at(ip)
            raylet.suspend()
            return raylet
        time.sleep(0.02)
    raise AssertionError(f"no raylet at {ip} started")


def test_a_node_too_slow_for_rays_start_up_wait_or_whose_raylet_died_joins_again(
    multinode: MultiNode,
) -> None:
    cluster_dir = multinode.work / "ray"
    up = subprocess.Popen(
        [sys.executable, "-m", "harbor_hpc", "ray", "up", "--nodes", "3", "--cpus-per-node", "2",
         "--partition", "multi", "--time", "30", "--wait-timeout", "240",
         "--cluster-dir", str(cluster_dir), "--json"],
        env=multinode.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stuck = stop_first_raylet_of(ADDRESS["n3"], time.monotonic() + 180)
        out, err = up.communicate(timeout=300)
        assert up.returncode == 0, err
        assert not stuck.is_running() or stuck.status() == psutil.STATUS_ZOMBIE
        job_id = json.loads(out)["job_id"]
        status = ray_status(multinode, cluster_dir)
        assert {node["ip"] for node in status["ray_nodes"]} == set(ADDRESS.values())
        log = (cluster_dir / f"job-{job_id}.log").read_text()
        assert "ray start failed (exit code 1: " in log and "(2 of 3)" in log, log[-3000:]

        # A node whose Ray ends while the node stays in the job (its raylet killed) joins again.
        (gone,) = [node for node in status["ray_nodes"] if node["ip"] == ADDRESS["n2"]]
        raylet_at(ADDRESS["n2"]).kill()
        deadline = time.monotonic() + 120
        while True:
            status = ray_status(multinode, cluster_dir)
            at_n2 = {
                n["node_id"]: n["status"] for n in status["ray_nodes"] if n["ip"] == ADDRESS["n2"]
            }
            if at_n2.get(gone["node_id"]) == "DEAD" and "IDLE" in at_n2.values():
                break
            assert time.monotonic() < deadline, at_n2
            time.sleep(1)
    finally:
        up.kill()
        cli("ray", "down", "--cluster-dir", str(cluster_dir), env=multinode.env, check=False)
