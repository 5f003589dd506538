"""What a `harbor-hpc ray up` job runs on each of its nodes: `python -m harbor_hpc.ray.node DIR`.

Slurm's first task starts the Ray head, the others workers (Ray's own Slurm pattern); with
`--join ADDRESS` every task is a worker of that running cluster (a trainer's). The head
takes a free port (`--port=0`, no race with other users of the node) and writes the address
it got into DIR for the workers and `ray up` to read. Each node keeps Ray's files (sockets,
logs, `ray_current_cluster`) in a private temporary folder of its own: Ray's default /tmp/ray
is world-writable and shared, so two users' clusters on one node would collide there. The
token is read from the 0600 file in DIR (RAY_AUTH_TOKEN_PATH); it is never an argument.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from types import FrameType

import psutil

from harbor_hpc.apptainer.scratch import PrivateDir
from harbor_hpc.core.files import atomic_write_text

# How often the head looks for Ray's address file, and workers for the head's address.
POLL_S = 0.5
# How long Ray may take to stop when the job ends, before the temporary folder is removed:
# well within the seconds Slurm gives a cancelled step before it kills it (KillWait).
STOP_S = 2.0


def address_file(cluster_dir: Path, job_id: str) -> Path:
    """Where the head of job `job_id` writes its address: one file per job, so that an
    earlier cluster's address is never read for this one's."""
    return cluster_dir / f"{job_id}.address"


def use_token(env: MutableMapping[str, str], cluster_dir: Path) -> None:
    """Set `env` up for Ray to run or be asked with token authentication and this cluster's
    token file. A RAY_AUTH_TOKEN of the user's would win over the file in Ray's lookup, so it
    goes."""
    env.pop("RAY_AUTH_TOKEN", None)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(cluster_dir / "token")


def _memory_share() -> list[str]:
    """With several Ray nodes on one Slurm node, each node's share of its memory (the job's
    --mem, else the machine's), split about as Ray splits a node's by default (7/10 for tasks
    and actors, 3/10 for objects): each would otherwise offer all of it, and Ray would place on
    the machine several times what it has."""
    # A count, as `ray up` asks with --ntasks-per-node; anything else counts as one.
    value = os.environ.get("SLURM_NTASKS_PER_NODE", "1")
    tasks = int(value) if value.isdigit() else 1
    if tasks <= 1:
        return []
    mem_mb = os.environ.get("SLURM_MEM_PER_NODE")
    total = int(mem_mb) << 20 if mem_mb else psutil.virtual_memory().total
    return [
        f"--memory={total * 7 // 10 // tasks}",
        f"--object-store-memory={total * 3 // 10 // tasks}",
    ]


def _ray_start(*options: str) -> list[str]:
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "1")
    return [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        f"--num-cpus={cpus}",
        *_memory_share(),
        "--disable-usage-stats",
        *options,
    ]


def _wait_for(path: Path, ray: subprocess.Popen[bytes] | None) -> str:
    """The content of `path` once it exists; exits when `ray` ends before it does."""
    while not path.exists():
        if ray is not None and ray.poll() is not None:
            sys.exit(f"ray start ended with exit code {ray.returncode} before it had an address")
        time.sleep(POLL_S)
    return path.read_text().strip()


def _terminate(signum: int, frame: FrameType | None) -> None:
    # scancel and the time limit send SIGTERM: end Ray and remove the temporary folder.
    sys.exit(128 + signum)


def main(cluster_dir: Path, join: str | None, labels: str | None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    job_id = os.environ["SLURM_JOB_ID"]
    head = join is None and os.environ.get("SLURM_PROCID", "0") == "0"
    own = [f"--labels={labels}"] if labels else []
    private = PrivateDir("harbor-hpc-ray-")  # 0700, node-local
    temp_dir = private.path
    # Ray SIGKILLs what a dead worker started: an environment host's Apptainer would die before
    # unmounting its images, leaving its FUSE helpers behind. Left alone, each container ends
    # by itself once its host is gone (its command channel closes) and Apptainer cleans up.
    # The environments' scratch space (TMPDIR of Ray's workers: their hosts' transfers, the
    # containers' overlays) is in there too, so whatever a killed host left goes with the node.
    scratch = temp_dir / "tmp"
    scratch.mkdir()
    env = dict(
        os.environ,
        RAY_TMPDIR=str(temp_dir),
        TMPDIR=str(scratch),
        RAY_kill_child_processes_on_worker_exit="0",
        # Ray runs its workers at niceness 15 by default; the containers would then run at 15
        # where Docker runs them at 0 (a task sees it), and lose every processor to the
        # node's other work. At 0 they share as in a Slurm job or Docker.
        RAY_worker_niceness="0",
    )
    use_token(env, cluster_dir)
    # Popen, not `core.proc.run` (bounded in time): Ray is this task's service, for the job's life.
    ray: subprocess.Popen[bytes] | None = None
    try:
        if head:
            ray = subprocess.Popen(
                _ray_start("--head", "--port=0", "--include-dashboard=false", *own), env=env
            )
            address = _wait_for(temp_dir / "ray" / "ray_current_cluster", ray)
            atomic_write_text(address_file(cluster_dir, job_id), address + "\n")
        else:
            address = join or _wait_for(address_file(cluster_dir, job_id), None)
            ray = subprocess.Popen(_ray_start(f"--address={address}", *own), env=env)
        return ray.wait()
    finally:
        if ray is not None and ray.poll() is None:
            ray.terminate()
            try:
                ray.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                ray.kill()  # Ray drains for up to 30 s: longer than Slurm's usual KillWait
        private.remove()  # overlays hold files of the user's subordinate uids


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m harbor_hpc.ray.node")
    parser.add_argument("cluster_dir", type=Path)
    parser.add_argument("--join", help="the address of a running cluster to join as workers")
    parser.add_argument("--labels", help="the node labels, key=value,...")
    arguments = parser.parse_args()
    sys.exit(main(arguments.cluster_dir, arguments.join, arguments.labels))
