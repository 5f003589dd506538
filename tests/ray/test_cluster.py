"""`harbor-hpc ray up / status / down` on the real Slurm, as the ordinary test user.

One cluster serves the module (starting one takes seconds of the machine's two cores): two Ray
nodes on this one Slurm node, each with a CPU, started once, asked, used, probed as another
user, and ended by the last test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from harbor_hpc.core.cluster_name import slurm_cluster_name
from harbor_hpc.ray.cluster import UpOptions, job_script, memory_per_node
from harbor_hpc.slurm.cluster import SlurmPlacement, job_state
from tests.support.cli import cli, cli_json
from tests.support.users import other_user_command

pytestmark = [pytest.mark.slurm, pytest.mark.ray]

# Asks the GCS at argv[1] for its nodes, as `harbor-hpc ray status` does, with whatever token
# the environment holds.
ASK_GCS = """
import sys
from ray._raylet import GcsClient
from ray.autoscaler.v2.sdk import get_cluster_resource_state
get_cluster_resource_state(GcsClient(address=sys.argv[1]))
print("answered")
"""

# squeue's word for a job that ended or is ending (None: it left the queue).
JOB_GONE = (None, "COMPLETING", "CANCELLED")


# A task pinned to each alive node: its node id, uid and Ray temporary folder.
ON_EACH_NODE = """
import json, os, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(logging_level="ERROR")

@ray.remote(num_cpus=1)
def where():
    temp = os.environ["RAY_TMPDIR"]
    return {"node": ray.get_runtime_context().get_node_id(), "uid": os.getuid(),
            "temp": temp, "temp_mode": os.stat(temp).st_mode & 0o777}

pinned = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], False))
          for node in ray.nodes() if node["Alive"]]
for answer in ray.get([task.remote() for task in pinned]):
    print(json.dumps(answer))
"""


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ray") / "cluster"


@pytest.fixture(scope="module")
def started(cluster_dir: Path) -> Iterator[tuple[dict[str, Any], subprocess.CompletedProcess[str]]]:
    # A site's lines, as a `module` function and its call (each job of ours runs them first).
    mark = cluster_dir.parent / "setup-ran"
    up = cli(
        "ray", "up", "--nodes", "1", "--ray-nodes-per-node", "2", "--cpus-per-node", "1",
        "--time", "10", "--cluster-dir", str(cluster_dir), "--json",
        "--setup", f'site_module() {{ echo "loaded $* in $SLURM_JOB_ID" >> {mark}; }}',
        "--setup", "site_module apptainer",
    )  # fmt: skip
    yield json_of(up), up
    if (cluster_dir / "cluster.json").exists():
        cli("ray", "down", "--cluster-dir", str(cluster_dir), check=False)


def json_of(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def test_up_prints_the_address_and_keeps_the_token_private(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]], cluster_dir: Path
) -> None:
    cluster, up = started
    assert set(cluster) == {
        *("address", "job_id", "nodes", "cluster_dir", "token_file", "log", "joined", "labels"),
        *("slurm_cluster", "mem_mb_per_node"),
    }
    assert cluster["slurm_cluster"] == slurm_cluster_name()
    assert cluster["joined"] is False
    host, _, port = cluster["address"].rpartition(":")
    assert host and port.isdigit()
    token_file = Path(cluster["token_file"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(cluster_dir.stat().st_mode) == 0o700
    token = token_file.read_text().strip()
    assert len(token) == 64
    # Nowhere but its file: not in what `up` printed, the job's script or log, or any command
    # line of the user's processes (Ray's among them).
    assert token not in up.stdout + up.stderr
    assert token not in (cluster_dir / "job.sh").read_text()
    assert token not in Path(cluster["log"]).read_text()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert token.encode() not in cmdline.read_bytes(), cmdline
        except OSError:
            continue  # a process that ended, or another user's


def test_the_job_asks_for_the_memory_it_was_given_and_says_so(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]], cluster_dir: Path
) -> None:
    """Without --mem, where the site sets no default memory, the job held every node's whole
    memory, and a batch beside it waited (Resources) for the cluster's end. The test cluster
    sets DefMemPerCPU: the site's default, said so; `--mem-per-node` is asked as given."""
    cluster, up = started
    assert cluster["mem_mb_per_node"] is None
    assert "the site's default memory a node (--mem-per-node)" in up.stderr
    assert "--mem=" not in (cluster_dir / "job.sh").read_text()
    options = UpOptions(nodes=1, placement=SlurmPlacement(), mem_mb_per_node=3000)
    assert "#SBATCH --mem=3000M" in job_script(cluster_dir, options)
    assert memory_per_node(options) == 3000


def test_a_folder_of_another_slurm_clusters_ray_cluster_is_never_overwritten(
    tmp_path: Path,
) -> None:
    """`ray up` from a second cluster (another SLURM_CONF) could not ask the first's job, took
    it for ended, and overwrote its files and token while it ran on."""
    folder = tmp_path / "cluster"
    folder.mkdir()
    theirs = {"address": "10.0.0.5:6379", "job_id": "77", "nodes": 1, "cluster_dir": str(folder),
              "token_file": str(folder / "token"), "log": str(folder / "job-77.log"),
              "slurm_cluster": "another-cluster"}  # fmt: skip
    (folder / "cluster.json").write_text(json.dumps(theirs))
    (folder / "token").write_text("theirs\n")
    up = cli("ray", "up", "--nodes", "1", "--cluster-dir", str(folder), check=False)
    assert up.returncode == 2, up.stderr
    assert "holds a Ray cluster of Slurm cluster another-cluster (job 77" in up.stderr
    assert json.loads((folder / "cluster.json").read_text()) == theirs
    assert (folder / "token").read_text() == "theirs\n"
    assert "Slurm job" not in up.stderr  # nothing queued


def test_the_job_ran_the_sites_setup_lines_first(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]], cluster_dir: Path
) -> None:
    up, _ = started
    assert (cluster_dir.parent / "setup-ran").read_text() == f"loaded apptainer in {up['job_id']}\n"


def test_status_shows_the_node_and_its_free_resources(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]], cluster_dir: Path
) -> None:
    cluster, _ = started
    status = cli_json("ray", "status", "--cluster-dir", str(cluster_dir))
    assert status["job_state"] == "RUNNING"
    assert status["address"] == cluster["address"]
    nodes = status["ray_nodes"]
    assert len({node["node_id"] for node in nodes}) == 2 == cluster["nodes"]
    assert [node["head"] for node in nodes].count(True) == 1
    for node in nodes:
        assert node["status"] in ("IDLE", "RUNNING")
        assert node["total"]["CPU"] == 1
        assert "token" not in {key.lower() for key in node}
    # Two Ray nodes on one machine share what the job holds there (the site's DefMemPerCPU
    # times its CPUs), not each offer the machine's memory, which the job's cgroup would cut.
    offered = sum(node["total"]["memory"] + node["total"]["object_store_memory"] for node in nodes)
    shown_job = subprocess.run(
        ["scontrol", "show", "job", cluster["job_id"]], capture_output=True, text=True
    ).stdout
    held = re.search(r"\bmem=(\d+)M", shown_job)
    assert held is not None, shown_job
    assert offered <= int(held.group(1)) << 20 <= psutil.virtual_memory().total
    assert offered >= (int(held.group(1)) << 20) * 0.9
    shown = cli("ray", "status", "--cluster-dir", str(cluster_dir)).stdout
    assert cluster["address"] in shown and "(head)" in shown


def test_status_without_ray_here_says_so_not_that_the_head_is_lost(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]], cluster_dir: Path
) -> None:
    hidden = (
        "import sys; sys.modules['ray'] = None; sys.argv = ['harbor-hpc', *sys.argv[1:]]; "
        "from harbor_hpc.cli import main; main()"
    )
    ran = subprocess.run(
        [sys.executable, "-c", hidden, "ray", "status", "--cluster-dir", str(cluster_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.returncode == 2, ran.stderr
    assert "Ray is not installed here" in ran.stderr and "RUNNING" in ran.stderr
    assert "head is lost" not in ran.stdout + ran.stderr


def test_the_owner_runs_tasks_on_each_node_with_the_token_file(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]],
) -> None:
    cluster, _ = started
    env = {
        **os.environ,
        "RAY_ADDRESS": cluster["address"],
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": cluster["token_file"],
        # Below `uv run` (pytest is), Ray would start the workers through `uv run` in a copy
        # of this checkout, building it from the package index (docs/ray.md): not what is tested.
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    }
    ran = subprocess.run(
        [sys.executable, "-c", ON_EACH_NODE], env=env, capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    answers = [json.loads(line) for line in ran.stdout.splitlines()]
    assert len({answer["node"] for answer in answers}) == 2
    temp_dirs = {answer["temp"] for answer in answers}
    assert len(temp_dirs) == 2  # a private folder per Ray node, not the shared /tmp/ray
    for answer in answers:
        assert answer["uid"] == os.getuid()
        assert answer["temp_mode"] == 0o700


@pytest.mark.other_user
def test_another_user_cannot_connect_or_read_the_token(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]],
) -> None:
    cluster, _ = started
    read = subprocess.run(
        other_user_command(["cat", cluster["token_file"]]), capture_output=True, text=True
    )
    assert read.returncode != 0 and not read.stdout
    for env in (
        {},  # no authentication at all
        {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},  # a wrong token
    ):
        asked = subprocess.run(
            other_user_command([sys.executable, "-c", ASK_GCS, cluster["address"]], env),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert asked.returncode != 0, env
        assert "answered" not in asked.stdout
        # The cluster refuses: Ray's own client, without a token, refuses before it asks.
        assert "InvalidAuthToken" in asked.stderr, asked.stderr[-2000:]


def test_a_second_up_in_the_same_folder_is_refused(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]], cluster_dir: Path
) -> None:
    cluster, _ = started
    again = cli("ray", "up", "--nodes", "1", "--cluster-dir", str(cluster_dir), check=False)
    assert again.returncode == 2
    assert f"already up in {cluster_dir} (job {cluster['job_id']}" in again.stderr


def test_down_ends_the_job_and_removes_the_token(
    started: tuple[dict[str, Any], subprocess.CompletedProcess[str]], cluster_dir: Path
) -> None:
    cluster, _ = started
    down = cli_json("ray", "down", "--cluster-dir", str(cluster_dir))
    assert down["job_id"] == cluster["job_id"]
    assert job_state(cluster["job_id"]) in JOB_GONE
    assert not Path(cluster["token_file"]).exists()
    assert not (cluster_dir / "cluster.json").exists()
    gone = cli("ray", "status", "--cluster-dir", str(cluster_dir), check=False)
    assert gone.returncode == 2 and "no Ray cluster in" in gone.stderr


def test_a_partition_slurm_refuses_is_named(tmp_path: Path) -> None:
    up = cli(
        "ray", "up", "--nodes", "1", "--partition", "no-such-partition",
        "--cluster-dir", str(tmp_path / "cluster"), check=False,
    )  # fmt: skip
    assert up.returncode == 2
    assert "Slurm refused the Ray cluster job" in up.stderr
    assert "Invalid partition name" in up.stderr  # Slurm's own words
    assert not (tmp_path / "cluster" / "cluster.json").exists()
    assert not (tmp_path / "cluster" / "token").exists()


def test_labels_that_are_not_key_value_are_refused_before_anything_is_queued(
    tmp_path: Path,
) -> None:
    for labels in ("roleenv", "role=env,=cpu"):
        up = cli(
            "ray", "up", "--nodes", "1", "--labels", labels,
            "--cluster-dir", str(tmp_path / "cluster"), check=False,
        )  # fmt: skip
        assert up.returncode == 2, up.stderr
        assert f"--labels {labels!r}: " in up.stderr and "is not key=value" in up.stderr
        assert "Traceback" not in up.stderr and "Slurm job" not in up.stderr
        assert not (tmp_path / "cluster").exists()


def test_a_cluster_not_up_in_time_is_cancelled_and_forgotten(tmp_path: Path) -> None:
    cluster_dir = tmp_path / "cluster"
    up = cli(
        "ray", "up", "--nodes", "1", "--wait-timeout", "1", "--cluster-dir", str(cluster_dir),
        check=False,
    )  # fmt: skip
    assert up.returncode == 1, up.stderr
    # Running, or still pending where the other tests' jobs hold the node: either way given up.
    assert re.search(r"after 1 s(, pending \(Slurm: \w+\))?; cancelled it", up.stderr), up.stderr
    job_id = up.stderr.split("Ray cluster job ", 1)[1].split(":", 1)[0]
    assert job_state(job_id) in JOB_GONE
    assert not (cluster_dir / "cluster.json").exists()
    assert not (cluster_dir / "token").exists()
    assert not list(cluster_dir.glob("*.address"))


def test_a_cluster_slurm_will_never_start_fails_at_once_with_slurms_reason(
    tmp_path: Path,
) -> None:
    # Three nodes of a one-node partition: Slurm keeps the job pending for good
    # (PartitionConfig or PartitionNodeLimit), which up no longer waits out (600 s by default).
    started = time.monotonic()
    up = cli(
        "ray", "up", "--nodes", "3", "--cluster-dir", str(tmp_path / "cluster"), check=False,
    )  # fmt: skip
    assert up.returncode == 1, up.stderr
    assert time.monotonic() - started < 60
    error = next(line for line in up.stderr.splitlines() if line.startswith("error: "))
    assert "Slurm will never start the Ray cluster job" in error, error
    assert re.search(r"\(Partition\w+: it asks for more than the partition", error), error
    assert error.endswith("cancelled it")
    assert "see its log" not in up.stderr  # a job that never ran wrote none
    job_id = error.split("Ray cluster job ", 1)[1].split()[0]
    assert job_state(job_id) in JOB_GONE
    assert not (tmp_path / "cluster" / "cluster.json").exists()


# `kill`, `timeout` or the scancel of a job running it; the terminal it waits in closed.
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP])
def test_up_told_to_stop_while_waiting_cancels_its_job(
    stop: signal.Signals, tmp_path: Path
) -> None:
    # A job told to begin in an hour: it waits in the queue (BeginTime) for longer than this.
    cluster_dir = tmp_path / "cluster"
    # SIGHUP at its default, as under a terminal, whatever this run inherited (`nohup`).
    up = subprocess.Popen(
        ["env", "--default-signal=HUP", sys.executable, "-m", "harbor_hpc", "ray", "up",
         "--nodes", "1", "--sbatch-arg=--begin=now+3600", "--cluster-dir", str(cluster_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    job_id = ""
    try:
        assert up.stderr is not None
        queued = up.stderr.readline()
        assert queued.startswith("Slurm job "), queued + up.stderr.read()
        job_id = queued.split()[2].rstrip(":")
        # Why it waits, in Slurm's words, as soon as Slurm has one (read with a timeout: the
        # reader is left behind, not waited for, should the line never come).
        pending = ThreadPoolExecutor(1).submit(up.stderr.readline).result(timeout=30)
        assert pending.startswith(f"Slurm job {job_id} is pending: "), pending
        # BeginTime, or Resources while the other tests' jobs hold the node.
        assert pending.split(": ", 1)[1].strip() not in ("", "None"), pending
        up.send_signal(stop)
        _, err = up.communicate(timeout=60)
    finally:
        up.kill()
        left = job_state(job_id) if job_id else None
        if left not in JOB_GONE:  # a failing test leaves no job queued
            subprocess.run(["scancel", job_id], check=False)
    assert up.returncode == 128 + stop, err
    assert "terminated" in err and "error" not in err
    assert left in JOB_GONE, left
    assert not (cluster_dir / "token").exists()
    assert not (cluster_dir / "cluster.json").exists()


def test_join_and_token_file_go_together(tmp_path: Path) -> None:
    cluster_dir = tmp_path / "cluster"
    where = ("--cluster-dir", str(cluster_dir))
    alone = cli("ray", "up", "-N", "1", "--join", "10.0.0.5:6379", *where, check=False)
    assert alone.returncode == 2
    assert "joining 10.0.0.5:6379 needs that cluster's token file" in alone.stderr
    token = tmp_path / "token"
    token.write_text("0" * 64)
    stray = cli("ray", "up", "-N", "1", "--token-file", str(token), *where, check=False)
    assert stray.returncode == 2 and "--token-file goes with --join" in stray.stderr
    assert not (cluster_dir / "token").exists()
