"""`RaySingularityEnvironment` on a real two-node Ray cluster (`harbor-hpc ray up` on Slurm),
as the ordinary test user: the container on a Ray node, commands and files through its host,
placement by cpus and labels, and the faults (a host killed, a node lost, the cluster gone)
ending the environment with one infrastructure error naming the node, never a hang.

Each test drives the environment from a process of its own, as a trainer would: Ray joins one
cluster per process, and a cluster that dies takes its drivers' Ray state with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.containers.errors import ContainerStartFailed
from harbor_hpc.ray.environment import RaySingularityEnvironment
from harbor_hpc.ray.host import CHUNK_BYTES
from tests.ray.conftest import RayCluster
from tests.support.processes import ENDED_WITHIN_S, container_processes, gone_within
from tests.support.sample_tasks import answer_service, make_task

pytestmark = [pytest.mark.slurm, pytest.mark.ray, pytest.mark.apptainer, pytest.mark.docker]

# What every driver starts with: `make(name, **kwargs)` gives an environment of the test's
# task on the cluster in CLUSTER_DIR, `show(...)` prints a JSON line for the test to read.
DRIVER = """
import asyncio, json, logging, os, sys, time
from pathlib import Path
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths
from harbor_hpc.environment import RaySingularityEnvironment

SIF, FOLDER, CLUSTER_DIR = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
(FOLDER / "environment").mkdir(parents=True, exist_ok=True)

def make(name, memory_mb=256, **kwargs):
    paths = TrialPaths(FOLDER / name)
    paths.mkdir()
    kwargs.setdefault("ray_cpus", 0.1)
    return RaySingularityEnvironment(
        environment_dir=FOLDER / "environment", environment_name=name,
        session_id=f"{name}__env", trial_paths=paths,
        task_env_config=EnvironmentConfig(docker_image=SIF, memory_mb=memory_mb),
        logger=logging.getLogger(name), ray_cluster_dir=CLUSTER_DIR, **kwargs)

def show(**values):
    print(json.dumps(values), flush=True)
"""


def drive(
    body: str,
    sif: Path,
    folder: Path,
    cluster_dir: str | Path,
    *more: str,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """Start a driver process running `body` (an `async def main()` and what it needs), in
    this environment and `env`."""
    script = DRIVER + body + "\nasyncio.run(main())\n"
    return subprocess.Popen(
        [sys.executable, "-c", script, str(sif), str(folder), str(cluster_dir), *more],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def lines(driver: subprocess.Popen[str], timeout: float = 180) -> list[dict[str, Any]]:
    """Every JSON line the driver printed, once it ended well."""
    out, err = driver.communicate(timeout=timeout)
    assert driver.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def next_line(driver: subprocess.Popen[str]) -> dict[str, Any]:
    """The driver's next JSON line (Ray prints its own news about dead workers there too)."""
    assert driver.stdout is not None
    while line := driver.stdout.readline():
        if line.startswith("{"):
            answer: dict[str, Any] = json.loads(line)
            return answer
    raise AssertionError(f"the driver ended: {driver.communicate()[1][-3000:]}")


# -- what the environment does, on the shared cluster --------------------------------------

SAME_AS_LOCAL = """
COMMANDS = ["id -u", "pwd", "echo $HOME", "touch /etc/x && echo writable", "ls /logs", "nice"]

async def main():
    from harbor_hpc.containers.environment import SingularityEnvironment
    remote = make("remote")
    local = SingularityEnvironment(
        environment_dir=FOLDER / "environment", environment_name="local",
        session_id="local__env", trial_paths=TrialPaths(FOLDER / "local"),
        task_env_config=EnvironmentConfig(docker_image=SIF, memory_mb=256))
    await asyncio.gather(remote.start(False), local.start(False))
    answers = {}
    for name, environment in (("remote", remote), ("local", local)):
        answers[name] = [
            (r.stdout, r.return_code)
            for r in [await environment.exec(c, timeout_sec=30) for c in COMMANDS]
        ]
    answers["env"] = (await remote.exec("echo $A-$B", env={"A": "1", "B": "two words"})).stdout
    answers["user"] = (await remote.exec("id -un", user="nobody")).stdout
    # A phase's network policy is the node's container's: Harbor switches it through the driver.
    host = os.environ.get("HARBOR_HPC_TEST_EGRESS_HOST", "10.79.0.2")
    code = ("import socket; connection = socket.create_connection(('%s', 2222), timeout=30); "
            "print(connection.recv(20).decode().strip())" % host)
    reach = f'python3 -c "{code}" 2>&1 | tail -n 1'
    await remote.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
    answers["closed"] = (await remote.exec(reach)).stdout
    await remote.set_network_policy(NetworkPolicy())
    answers["open"] = (await remote.exec(reach)).stdout
    answers["timeout"] = ""
    try:
        await remote.exec("sleep 5", timeout_sec=1)
    except RuntimeError as error:
        answers["timeout"] = f"{type(error).__name__}: {error}"
    show(node=remote.node, pid=os.getpid(), **answers)
    await asyncio.gather(remote.stop(True), local.stop(True))
"""


@pytest.mark.egress
def test_commands_answer_as_in_the_local_environment(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    (answer,) = lines(drive(SAME_AS_LOCAL, debian_sif, tmp_path, ray_cluster["cluster_dir"]))
    assert answer["remote"] == answer["local"]
    assert answer["remote"][0] == ["0\n", 0]  # root in the container, as in Docker
    assert answer["remote"][-1] == ["0\n", 0]  # niceness 0, as in Docker (Ray's default: 15)
    assert answer["env"] == "1-two words\n"
    assert answer["user"] == "nobody\n"
    assert "ConnectionRefusedError" in answer["closed"], answer["closed"]
    assert answer["open"] == "reached 2222\n"
    assert answer["timeout"] == "RuntimeError: Command timed out after 1 seconds"
    assert answer["node"] == ray_cluster["address"].rpartition(":")[0]
    # The container's processes are not the driver's: they run under the node's Ray host.
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []


POD = """
async def main():
    environment = make("pod", memory_mb=512)
    await environment.start(False)
    fetch = ("python3 -c \\"import urllib.request as u; "
             "print(u.urlopen('http://answers:8000/answer').read().decode().strip())\\"")
    fetched = await environment.exec(fetch)
    beside = await environment.service_exec("hostname; id -u; echo $HOME", service="answers")
    await environment.service_download_file("/srv/answer", FOLDER / "answer", service="answers")
    await environment.service_download_dir("/srv", FOLDER / "srv", service="answers")
    await environment.stop_service("answers")
    gone = await environment.exec(fetch + " 2>&1 | tail -n 1")
    show(fetched=fetched.stdout, beside=beside.stdout, downloaded=(FOLDER / "answer").read_text(),
         folder=sorted(p.name for p in (FOLDER / "srv").iterdir()), gone=gone.stdout,
         compose=environment.capabilities.docker_compose)
    await environment.stop(True)
"""


def test_a_compose_tasks_services_run_beside_it_on_its_node(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    """The pod runs on the node: the task reaches its service by name, and Harbor's
    per-service exec, download and stop go to the service there."""
    (tmp_path / "environment").mkdir()
    (tmp_path / "environment" / "docker-compose.yaml").write_text(answer_service(str(debian_sif)))
    (answer,) = lines(drive(POD, debian_sif, tmp_path, ray_cluster["cluster_dir"]))
    assert answer["compose"] is True
    assert answer["fetched"] == "42\n"
    assert answer["beside"].split() == ["answers", "0", "/root"]
    assert answer["downloaded"] == "42\n" and answer["folder"] == ["answer"]
    assert "Connection refused" in answer["gone"], answer["gone"]


FILES = """
async def main():
    environment = make("files")
    await environment.start(False)
    source = Path(sys.argv[4])
    await environment.upload_dir(source, "/data/in here")
    await environment.upload_file(source / "big.bin", "/single/big.bin")
    sums = await environment.exec("cd '/data/in here' && sha256sum big.bin 'a b/c.txt' "
                                  "&& readlink link && sha256sum /single/big.bin")
    await environment.download_dir("/data/in here", FOLDER / "back")
    await environment.download_file("/single/big.bin", FOLDER / "back-single.bin")
    await environment.stop(True)
    show(sums=sums.stdout)
"""


def test_big_folders_and_files_cross_in_chunks_both_ways(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    (source / "a b").mkdir(parents=True)
    big = os.urandom(2 * CHUNK_BYTES + 12345)  # three chunks each way
    (source / "big.bin").write_bytes(big)
    (source / "a b" / "c.txt").write_text("spaces kept\n")
    (source / "link").symlink_to("a b/c.txt")
    (answer,) = lines(
        drive(FILES, debian_sif, tmp_path, ray_cluster["cluster_dir"], str(source)), timeout=300
    )
    sums = answer["sums"].splitlines()
    digest = hashlib.sha256(big).hexdigest()
    assert sums == [
        f"{digest}  big.bin",
        f"{hashlib.sha256(b'spaces kept\n').hexdigest()}  a b/c.txt",
        "a b/c.txt",
        f"{digest}  /single/big.bin",
    ]
    back = tmp_path / "back"
    assert (back / "big.bin").read_bytes() == big
    assert (back / "a b" / "c.txt").read_text() == "spaces kept\n"
    assert os.readlink(back / "link") == "a b/c.txt"
    assert (tmp_path / "back-single.bin").read_bytes() == big


PLACED = """
async def main():
    whole = [make(f"cpu{i}", ray_cpus=1) for i in range(2)]
    await asyncio.gather(*(environment.start(False) for environment in whole))
    show(nodes=[environment.node_id for environment in whole])
    third = make("third", ray_cpus=1, ray_placement_timeout_sec=5)
    note = third.trial_paths.trial_dir / "waiting-for.txt"

    async def look():  # while it waits, its folder says why (status reads it)
        await asyncio.sleep(3.5)
        return note.read_text().strip() if note.exists() else None

    waiting = asyncio.create_task(look())
    try:
        await third.start(False)
    except Exception as error:
        show(error=f"{type(error).__name__}: {error}", waiting=await waiting,
             after=note.exists())
    never = make("never", ray_cpus=3, ray_placement_timeout_sec=600)
    began = time.monotonic()
    try:
        await never.start(False)
    except Exception as error:
        show(error=f"{type(error).__name__}: {error}", seconds=time.monotonic() - began)
    await asyncio.gather(*(environment.stop(True) for environment in whole))
    again = make("again", ray_cpus=1)
    await again.start(False)  # what the others held is free again
    await again.stop(True)
"""


def test_placement_holds_the_tasks_cpus_and_says_when_no_node_has_room(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    placed, refused, never = lines(drive(PLACED, debian_sif, tmp_path, ray_cluster["cluster_dir"]))
    assert len(set(placed["nodes"])) == 2  # a CPU each: one per node of one CPU
    assert refused["error"].startswith("EnvironmentHostUnavailable: task third: no Ray node")
    assert "had room for {'CPU': 1.0, 'memory': 268435456.0} within 5 s" in refused["error"]
    assert refused["waiting"] == "waiting for a Ray node with room for 1 CPU, 256 MB"
    assert refused["after"] is False  # said only while it waited
    # More than any node offers in all: refused at once, not after its 600 s.
    assert never["error"].startswith(
        "EnvironmentHostUnavailable: task never: no Ray node can ever hold 3 CPU, 256 MB: "
        "the biggest offers 1 CPU"
    ), never
    assert never["seconds"] < 30


FORKS = """
async def main():
    from harbor_hpc.api import SandboxOptions, SandboxPool
    parent = make("parent")
    await parent.start(False)
    await parent.exec("echo parent > /root/a && chown 65534 /root/a")
    children = await parent.fork(2, step=3)
    seen = [(await c.exec("cat /root/a; stat -c %u /root/a")).stdout for c in children]
    for k, child in enumerate(children):
        await child.exec(f"echo {k} > /root/a")
    after = [(await e.exec("cat /root/a")).stdout for e in [parent, *children]]
    nodes = [e.node_id for e in [parent, *children]]
    branch = json.loads((children[0].trial_paths.trial_dir / "branch.json").read_text())
    await asyncio.gather(*(e.stop(True) for e in [parent, *children]))
    show(seen=seen, after=after, nodes=nodes, branch=branch,
         parent=str(parent.trial_paths.trial_dir))
    # A parent holding its node's whole CPU: its child goes to the other node, the copy with it
    # (held there within the parent's snapshot_storage_mb).
    whole = make("whole", ray_cpus=1, snapshot_storage_mb=64)
    await whole.start(False)
    await whole.exec("echo far > /root/far && chown 65534 /root/far && rm /etc/issue")
    (far,) = await whole.fork(1)
    probe = "cat /root/far; stat -c %u /root/far; test -e /etc/issue || echo gone"
    show(far=(await far.exec(probe)).stdout, nodes=[whole.node_id, far.node_id])
    await asyncio.gather(whole.stop(True), far.stop(True))
    # The sandbox API's branching rollout on Ray: forked at a turn, each child its own reward.
    kwargs = {"ray_cluster_dir": CLUSTER_DIR, "ray_cpus": 0.1}
    with SandboxPool(SandboxOptions(executor="ray", environment_kwargs=kwargs)) as pool:
        root = await pool.aopen(sys.argv[4])
        await root.aexec("echo 42 > /tmp/partial")
        right, wrong = await root.afork(2)
        await right.aexec("cat /tmp/partial > /tmp/answer")
        await wrong.aexec("echo 41 > /tmp/answer")
        results = [await child.averify() for child in (right, wrong)]
        show(
            rewards=[[r.reward, r.trainable] for r in results],
            parents=[r.branch.parent == root.id and r.branch.step == 1 for r in results],
        )
"""


def test_forks_on_ray_land_on_the_parents_node_and_branch_apart(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    """`fork` of a Ray environment, and a branching rollout of the sandbox API on Ray: each
    child on the node that holds the parent's copy, written apart, its reward its own; where
    that node has no room, on another, the copy sent there (owners and whiteouts kept)."""
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    driver = drive(FORKS, debian_sif, tmp_path / "run", ray_cluster["cluster_dir"], str(task))
    forks, far, branched = lines(driver, timeout=300)
    assert forks["seen"] == ["parent\n65534\n"] * 2
    assert forks["after"] == ["parent\n", "0\n", "1\n"]
    assert len(set(forks["nodes"])) == 1
    assert forks["branch"] == {"parent_trial": forks["parent"], "step": 3}
    assert far["far"] == "far\n65534\ngone\n" and len(set(far["nodes"])) == 2
    assert branched == {"rewards": [[1.0, True], [0.0, True]], "parents": [True, True]}


def test_unknown_kwargs_name_both_kinds_accepted(tmp_path: Path) -> None:
    with pytest.raises(ContainerStartFailed) as raised:
        RaySingularityEnvironment(
            environment_dir=tmp_path, environment_name="t", session_id="t__env",
            trial_paths=tmp_path, task_env_config=None, ray_cpu=1,
        )  # fmt: skip
    message = str(raised.value)
    assert "Unknown option 'ray_cpu'" in message and "\naccepted: " in message
    assert "ray_cpus" in message and "ray_labels" in message and "fakeroot" in message


def test_harbor_trial_start_loads_it_by_import_path_and_scores_the_oracle(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    """As users name it to Harbor's own CLI: `-e harbor_hpc.environment:RaySingularityEnvironment`
    with kwargs; the verifier's reward comes back from the node (the logs are copied, not
    mounted)."""
    from tests.containers.test_environment import reward, start_trial, trial_result

    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    trial = start_trial(
        task,
        tmp_path / "trials",
        f"ray_cluster_dir={ray_cluster['cluster_dir']}",
        "ray_cpus=0.5",
        environment="harbor_hpc.environment:RaySingularityEnvironment",
    )
    result = trial_result(task, tmp_path / "trials", trial)
    assert result["exception_info"] is None, result["exception_info"]
    assert reward(result) == 1.0


# Ray's own fault injection in the driver: calls to the hosts fail, the request lost before the
# host runs it or the answer lost after (Ray then says ActorUnavailableError: "the task may or
# may not have been executed").
LOSSY = """
async def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    environment = make("lossy")
    await environment.start(False)
    counts = []
    for _ in range(16):
        result = await environment.exec("echo x >> /tmp/runs; wc -l < /tmp/runs", timeout_sec=30)
        counts.append(int(result.stdout))
    sent = FOLDER / "sent.bin"
    sent.write_bytes(os.urandom(3 << 20))
    await environment.upload_file(sent, "/tmp/sent.bin")
    await environment.download_file("/tmp/sent.bin", FOLDER / "back.bin")
    show(counts=counts, same=(FOLDER / "back.bin").read_bytes() == sent.read_bytes())
    await environment.stop(True)
"""


def test_calls_whose_answer_ray_lost_are_asked_again_and_run_once(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    """A host Ray calls temporarily unavailable is waited for and asked again, never the end of
    the environment; no command runs twice, no file crosses twice."""
    lossy = {
        "CoreWorkerService.grpc_client.PushTask": {
            "num_failures": 10,
            "req_failure_prob": 20,
            "resp_failure_prob": 20,
        }
    }
    driver = drive(
        LOSSY,
        debian_sif,
        tmp_path,
        ray_cluster["cluster_dir"],
        env={"RAY_testing_rpc_failure": json.dumps(lossy)},
    )
    out, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, err[-3000:]
    (answer,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert answer["counts"] == list(range(1, 17)), "each command ran once, in order"
    assert answer["same"]
    assert "unavailable" in err, "no call was lost: the injection did not reach the hosts"
