"""Faults and a trainer's cluster: `RaySingularityEnvironment` on Ray clusters of each test's own
(`own_ray_cluster`; these tests break them). A host killed, a node lost or the cluster gone ends
the environment with one infrastructure error naming the node within seconds, never a hang, and
never the driver, while a host only busy is waited for; environments asking for a label go to
the nodes that joined with it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from harbor_hpc.runtimes.apptainer import FUSE_HELPERS
from harbor_hpc.slurm.cluster import queued_jobs
from tests.ray.conftest import RayCluster
from tests.ray.test_environment import drive, lines, next_line
from tests.support.cli import cli, cli_json
from tests.support.processes import ENDED_WITHIN_S, container_processes, gone_within, named

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.apptainer, pytest.mark.docker]


# -- a trainer's cluster, joined by labelled nodes ------------------------------------------

LABELLED = """
async def main():
    environments = [make(f"e{i}", ray_labels="role=env") for i in range(3)]
    await asyncio.gather(*(environment.start(False) for environment in environments))
    show(nodes=sorted({environment.node_id for environment in environments}))
    await asyncio.gather(*(environment.stop(True) for environment in environments))
"""


def test_environments_go_to_the_labelled_nodes_that_joined_a_trainers_cluster(
    own_ray_cluster: Callable[..., RayCluster], debian_sif: Path, tmp_path: Path
) -> None:
    trainer = own_ray_cluster("--ray-nodes-per-node", "1")
    joined = own_ray_cluster(
        "--ray-nodes-per-node", "1", "--labels", "role=env",
        "--join", trainer["address"], "--token-file", trainer["token_file"],
    )  # fmt: skip
    assert joined["joined"] and joined["address"] == trainer["address"]
    assert Path(joined["token_file"]).resolve() == Path(trainer["token_file"])  # linked
    nodes = cli_json("ray", "status", "--cluster-dir", joined["cluster_dir"])["ray_nodes"]
    workers = [node["node_id"] for node in nodes if not node["head"]]
    assert [node["labels"] for node in nodes if not node["head"]] == [{"role": "env"}]
    assert [node["labels"] for node in nodes if node["head"]] == [{}]
    shown = cli("ray", "status", "--cluster-dir", joined["cluster_dir"]).stdout
    assert "role=env" in shown
    (answer,) = lines(drive(LABELLED, debian_sif, tmp_path, joined["cluster_dir"]))
    assert answer["nodes"] == workers


# -- faults --------------------------------------------------------------------------------

STARTED_THEN_EXEC = """
async def main():
    environment = make("fault")
    await environment.start(False)
    show(node_id=environment.node_id, node=environment.node)
    sys.stdin.readline()  # the test breaks something meanwhile
    began = time.monotonic()
    try:
        await environment.exec("sleep 1; echo still here", timeout_sec=60)
        show(error=None)
    except Exception as error:
        show(error=f"{type(error).__name__}: {error}", after=time.monotonic() - began)
    began = time.monotonic()
    await environment.stop(True)
    show(stopped_after=time.monotonic() - began)
    sys.stdin.readline()  # the test says whether the cluster is still there to try again
    again = make("again")
    try:
        await again.start(False)
        show(again=(await again.exec("echo back")).stdout)
        await again.stop(True)
    except Exception as error:
        show(again=f"{type(error).__name__}: {error}")
"""


def break_then_exec(
    cluster: RayCluster,
    debian_sif: Path,
    tmp_path: Path,
    fault: Callable[[str], object],
    *,
    cluster_left: bool,
) -> list[dict[str, Any]]:
    """Start an environment, apply `fault` (given its node id), then exec and stop, and, when
    the cluster is left, start another: what the driver saw. (A driver whose cluster is gone
    is ended by Ray a minute later: it is not waited for.)"""
    driver = drive(STARTED_THEN_EXEC, debian_sif, tmp_path, cluster["cluster_dir"])
    try:
        placed = next_line(driver)
        fault(placed["node_id"])
        assert driver.stdin is not None
        driver.stdin.write("go\n")
        driver.stdin.flush()
        seen = [placed, next_line(driver), next_line(driver)]
        if not cluster_left:
            return seen
        driver.stdin.write("go\n")
        driver.stdin.flush()
        return [*seen, *lines(driver)]
    finally:
        driver.kill()
        driver.communicate()


def raylet_of(node_id: str) -> psutil.Process:
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["name"] == "raylet" and f"--node_id={node_id}" in cmdline:
            return process
    raise AssertionError(f"no raylet of node {node_id}")


def host_of(node_id: str) -> psutil.Process:
    raylet = raylet_of(node_id)
    for process in raylet.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ray::EnvironmentHost" in " ".join(process.cmdline()):
                return process
    raise AssertionError(f"no environment host on node {node_id}")


def assert_ended_naming_the_node(error: str, placed: dict[str, Any]) -> None:
    assert error.startswith(
        f"EnvironmentHostUnavailable: task fault: its Ray node {placed['node']} "
        f"(node id {placed['node_id'][:12]})"
    ), error


def test_a_killed_host_ends_its_environment_and_the_next_one_gets_a_new_host(
    own_ray_cluster: Callable[..., RayCluster], debian_sif: Path, tmp_path: Path
) -> None:
    cluster = own_ray_cluster()
    placed, failed, stopped, again = break_then_exec(
        cluster, debian_sif, tmp_path, lambda node_id: host_of(node_id).kill(), cluster_left=True
    )
    assert_ended_naming_the_node(failed["error"], placed)
    assert "was lost: The actor died unexpectedly" in failed["error"]
    assert failed["after"] < 5 and stopped["stopped_after"] < 5
    assert again["again"] == "back\n"
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []


def kill_host_but_not_its_fuse_helpers(node_id: str) -> None:
    """A host and its containers' starters killed outright, as the OOM killer or a crash can,
    while the FUSE helpers those starters ran are not: they keep their mount namespace alive
    and nobody is left to unmount what they serve."""
    host = host_of(node_id)
    below = named(host.children(recursive=True))  # one that ends meanwhile is left out
    assert any(name in FUSE_HELPERS for name in below.values())
    for process in [host, *(p for p, name in below.items() if name not in FUSE_HELPERS)]:
        with contextlib.suppress(psutil.Error):
            process.kill()


def test_fuse_helpers_left_by_a_killed_starter_end_while_the_node_lives_on(
    own_ray_cluster: Callable[..., RayCluster], debian_sif: Path, tmp_path: Path
) -> None:
    cluster = own_ray_cluster()
    placed, failed, _, again = break_then_exec(
        cluster, debian_sif, tmp_path, kill_host_but_not_its_fuse_helpers, cluster_left=True
    )
    assert_ended_naming_the_node(failed["error"], placed)
    assert again["again"] == "back\n"
    # The node's process took them in (a child subreaper) and ended them.
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []


def lose_node(node_id: str) -> None:
    """What a node's loss leaves of it: nothing. Its raylet and every process under it (the
    host, the containers) killed at once."""
    raylet = raylet_of(node_id)
    processes = [raylet, *raylet.children(recursive=True)]
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()


def test_a_lost_node_ends_its_environment_within_seconds(
    own_ray_cluster: Callable[..., RayCluster], debian_sif: Path, tmp_path: Path
) -> None:
    cluster = own_ray_cluster()
    # The cluster's one node is its head: the head's loss ends the job.
    placed, failed, stopped = break_then_exec(
        cluster, debian_sif, tmp_path, lose_node, cluster_left=False
    )
    assert_ended_naming_the_node(failed["error"], placed)
    assert failed["after"] < 30 and stopped["stopped_after"] < 30
    assert gone_within(15, lambda: container_processes(debian_sif)) == []


def test_a_cluster_gone_ends_its_environment_within_seconds(
    own_ray_cluster: Callable[..., RayCluster], debian_sif: Path, tmp_path: Path
) -> None:
    cluster = own_ray_cluster()

    def down(_: str) -> None:
        # scancel returns at once; Slurm ends the job's processes a moment later (SIGTERM to
        # its cgroup, Ray's graceful stop): the exec is tried once the job has left the queue.
        cli("ray", "down", "--cluster-dir", cluster["cluster_dir"])
        assert gone_within(30, lambda: sorted(queued_jobs([cluster["job_id"]]))) == []

    placed, failed, stopped = break_then_exec(
        cluster, debian_sif, tmp_path, down, cluster_left=False
    )
    assert_ended_naming_the_node(failed["error"], placed)
    assert failed["after"] < 30 and stopped["stopped_after"] < 30
    assert gone_within(15, lambda: container_processes(debian_sif)) == []


FROZEN = """
import harbor_hpc.ray.environment as ray_environment

# A probe's timeout of seconds instead of a minute: the test freezes the host for longer.
ray_environment.LIVENESS_SEC, ray_environment.PROBE_TIMEOUT_SEC = 1.0, 2.0

async def main():
    environment = make("busy")
    await environment.start(False)
    show(node_id=environment.node_id)
    sys.stdin.readline()  # the test freezes the host meanwhile
    began = time.monotonic()
    result = await environment.exec("echo still here", timeout_sec=60)
    show(stdout=result.stdout, after=time.monotonic() - began)
    await environment.stop(True)
"""


def test_a_host_too_busy_to_answer_probes_is_waited_for_while_its_node_lives(
    own_ray_cluster: Callable[..., RayCluster], debian_sif: Path, tmp_path: Path
) -> None:
    # A host starting a hundred containers on a loaded node can leave probes unanswered for
    # most of a minute: a host stopped for several probe timeouts stands in for it.
    cluster = own_ray_cluster()
    driver = drive(FROZEN, debian_sif, tmp_path, cluster["cluster_dir"])
    try:
        host = host_of(next_line(driver)["node_id"])
        host.suspend()
        try:
            assert driver.stdin is not None
            driver.stdin.write("go\n")
            driver.stdin.flush()
            time.sleep(8)
        finally:
            host.resume()
        answer = next_line(driver)
        assert answer["stdout"] == "still here\n" and answer["after"] >= 8
        assert lines(driver) == []
    finally:
        driver.kill()
        driver.communicate()


DIES = """
async def main():
    environments = [make(f"d{i}") for i in range(2)]
    await asyncio.gather(*(environment.start(False) for environment in environments))
    show(started=len(environments))
    os._exit(0)  # no stop(): the trainer died
"""


def test_a_driver_that_dies_leaves_nothing_running(
    own_ray_cluster: Callable[..., RayCluster], debian_sif: Path, tmp_path: Path
) -> None:
    cluster = own_ray_cluster()
    (started,) = lines(drive(DIES, debian_sif, tmp_path, cluster["cluster_dir"]))
    assert started == {"started": 2}
    # Ray ends the driver's hosts; each container then ends by itself, its FUSE helpers too.
    assert gone_within(20, lambda: container_processes(debian_sif)) == []
