"""What a `harbor-hpc ray up` job runs on each of its nodes: `python -m harbor_hpc.ray.node DIR`.

Slurm's first task starts the Ray head, the others workers (Ray's own Slurm pattern); with
`--join ADDRESS` every task is a worker of that running cluster (a trainer's). A worker whose
Ray ends (its raylet killed, its node given up by Ray) joins again while its node is still in
the job; otherwise it ends alone and the cluster goes on without it. The head's end is the
cluster's: it cancels the job, which ends every node. The head
takes a free port (`--port=0`, no race with other users of the node) and writes the address
it got into DIR for the workers and `ray up` to read. Each node keeps Ray's files (sockets,
logs, `ray_current_cluster`) in a private temporary folder of its own: Ray's default /tmp/ray
is world-writable and shared, so two users' clusters on one node would collide there. The
token is read from the 0600 file in DIR (RAY_AUTH_TOKEN_PATH); it is never an argument.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from types import FrameType

import psutil

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_write_text
from harbor_hpc.core.scratch import PrivateDir
from harbor_hpc.runtimes.apptainer import FUSE_HELPERS
from harbor_hpc.slurm import cluster

# How often the head looks for Ray's address file, and workers for the head's address.
POLL_S = 0.5
# How long Ray may take to stop when the job ends, before the temporary folder is removed:
# well within the seconds Slurm gives a cancelled step before it kills it (KillWait).
STOP_S = 2.0
# A worker whose `ray start` fails this soon tries again, this many times in all.
STARTUP_S = 90.0
START_ATTEMPTS = 3
# prctl(2): orphans below this process are given to it.
PR_SET_CHILD_SUBREAPER = 36


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


def job_memory_mb(env: Mapping[str, str]) -> int | None:
    """The memory the job holds on this node, in MB, as Slurm tells its steps: --mem
    (SLURM_MEM_PER_NODE), else per CPU (--mem-per-cpu, or the site's DefMemPerCPU:
    SLURM_MEM_PER_CPU) times the CPUs it holds here; None where Slurm says neither."""
    per_node = env.get("SLURM_MEM_PER_NODE", "")
    if per_node.isdigit():
        return int(per_node)
    per_cpu, cpus = env.get("SLURM_MEM_PER_CPU", ""), env.get("SLURM_CPUS_ON_NODE", "")
    if per_cpu.isdigit() and cpus.isdigit():
        return int(per_cpu) * int(cpus)
    return None


# A Ray node's object store: what our environments send through it, files in chunks of
# CHUNK_BYTES (one at a time each), 64 of them at once; Ray's own split (3/10 of the node)
# would keep gigabytes from the environments for objects nobody sends.
OBJECT_STORE_BYTES = 512 << 20


def _memory_share() -> list[str]:
    """Each Ray node's share of the memory its Slurm node gives the job (its --mem, else the
    machine's): the object store sized for what environments send (`OBJECT_STORE_BYTES`, or
    3/10 of a smaller share), the rest for environments. Ray would otherwise offer the
    machine's whole memory (where the job holds less, it would place more than the job's
    cgroup allows), or, with several Ray nodes on one Slurm node, each would offer all of it,
    and keep 3/10 of it for objects."""
    # A count, as `ray up` asks with --ntasks-per-node; anything else counts as one.
    value = os.environ.get("SLURM_NTASKS_PER_NODE", "1")
    tasks = int(value) if value.isdigit() else 1
    mem_mb = job_memory_mb(os.environ)
    total = mem_mb << 20 if mem_mb is not None else psutil.virtual_memory().total
    share = total // max(1, tasks)
    objects = min(share * 3 // 10, OBJECT_STORE_BYTES)
    return [f"--memory={share - objects}", f"--object-store-memory={objects}"]


def advertised_address(name: str | None) -> str | None:
    """The IPv4 address Ray should give for this node: the one Slurm knows the node by (its
    NodeAddr, resolved). Left to Ray (None) where Slurm names none or a loopback one (a
    one-node cluster). Ray's own guess is a route towards a public address, else the
    hostname's address: on nodes without a default route whose hostname maps to a loopback
    address (Debian's `127.0.1.1 host` line) the head would advertise one no other node reaches."""
    address = cluster.node_address(name) if name else None
    if address is None:
        return None
    try:
        found = socket.getaddrinfo(address, None, socket.AF_INET)
    except OSError:
        return None
    ips = [str(info[4][0]) for info in found]
    usable = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
    return usable[0] if usable else None


def _ray_start(temp_dir: Path, *options: str) -> list[str]:
    """`ray start` for this node, its files in `temp_dir`: named, for a worker would otherwise
    use the path of the head's folder on its own node, which nothing removes."""
    cpus = os.environ.get("SLURM_CPUS_PER_TASK", "1")
    address = advertised_address(os.environ.get("SLURMD_NODENAME"))
    return [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={cpus}",
        *([f"--node-ip-address={address}"] if address else []),
        *_memory_share(),
        "--disable-usage-stats",
        *options,
    ]


class NoAddress(Exception):
    """The head's `ray start` ended before it wrote the cluster's address."""


def wait_for_address(path: Path, ray: subprocess.Popen[bytes] | None) -> str:
    """The content of `path` once it has some; `NoAddress` when `ray` ends before. Ray
    creates its address file, then writes it (not atomically): a file seen in between is empty."""
    while True:
        with contextlib.suppress(FileNotFoundError):
            if said := path.read_text().strip():
                return said
        if ray is not None and ray.poll() is not None:
            raise NoAddress(
                f"ray start ended with exit code {ray.returncode} before it had an address"
            )
        time.sleep(POLL_S)


# Set once Slurm told the node to end (scancel, the time limit): KillWait seconds are left.
_terminated = threading.Event()


def _terminate(signum: int, frame: FrameType | None) -> None:
    # scancel and the time limit send SIGTERM: end Ray and remove the temporary folder.
    _terminated.set()
    sys.exit(128 + signum)


def _adopt_orphans() -> None:
    """Make this process the one that orphans below it are given to (a child subreaper), not
    init. Apptainer's FUSE helpers (squashfuse_ll, fuse-overlayfs) are its starter's children
    and run in the container's mount namespace, which they keep alive themselves: a starter
    killed outright (a host or raylet killed with its tree, the OOM killer) leaves them behind
    for good, outside anything Slurm tracks without cgroups. Given to this process, they end
    with it (`_end_descendants`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap(ray: subprocess.Popen[bytes]) -> int:
    """Wait for Ray to end. Meanwhile, of the orphans given to this process: collect the exit
    status of those that ended (they would stay zombies), and kill FUSE helpers, whose starter
    is gone and will never unmount what they serve. Other orphans (a starter whose host died,
    ending its container by itself) are left to end as they do."""
    while ray.poll() is None:
        for child in psutil.Process().children():
            if child.pid == ray.pid:
                continue
            with contextlib.suppress(ChildProcessError, psutil.Error):
                if child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
                elif child.name() in FUSE_HELPERS:
                    child.kill()
        time.sleep(POLL_S)
    return ray.returncode


class _RayStart:
    """`ray start` running, its output relayed to the job's log line by line, the last line
    that says what went wrong kept for the node's failure record."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.began = time.monotonic()
        self.said = ""
        self.process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE)
        self._relay = threading.Thread(target=self._relay_stderr, daemon=True)
        self._relay.start()

    def _relay_stderr(self) -> None:
        assert self.process.stderr is not None
        rank = 0
        for raw in self.process.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.buffer.flush()
            line = raw.decode(errors="replace").strip()
            weight = failure_rank(line)
            if weight and weight >= rank:
                rank, self.said = weight, line.split(" -- ", 1)[-1][:400]

    def wait(self) -> int:
        code = _reap(self.process)
        self._relay.join(timeout=STOP_S)
        return code


def failure_rank(line: str) -> int:
    """How well a line of `ray start`'s output says why it failed: 3 for Ray's own fatal log
    line (`... PANIC scripts.py:886 -- why`), 2 for an exception's (`Exception: why`), 1 for
    another that speaks of failure, 0 for the rest. The best, last of its rank, is kept."""
    if "\tPANIC " in line or " PANIC " in line:
        return 3
    if re.match(r"^[\w.]*(Error|Exception): ", line):
        return 2
    return int(any(word in line for word in ("Error", "timed out", "Failed", "failed")))


def failure_file(cluster_dir: Path, job_id: str, node: str) -> Path:
    """Where the node that could not start Ray says why, for `ray up` to name it."""
    return cluster_dir / f"{job_id}.{node}.failed"


def failures(cluster_dir: Path, job_id: str) -> list[str]:
    """What the nodes of job `job_id` said when Ray would not start on them."""
    return sorted(path.read_text().strip() for path in cluster_dir.glob(f"{job_id}.*.failed"))


def _keep_joined(
    command: list[str], env: dict[str, str], node: str, job_id: str
) -> tuple[_RayStart, int, int]:
    """Start a worker's Ray and keep it in the cluster. One whose `ray start` failed within
    STARTUP_S (Ray gives its raylet a fixed 30 s to register, which a busy node can miss)
    starts again, up to START_ATTEMPTS times in a row. One that was up longer and ended (its
    raylet killed, or given up by Ray after a partition) joins again, while Slurm still counts
    `node` in the job: a node it took out (failed under the job) would only be ended there. What
    the last one left is ended first. Ray, its exit code and the attempts in a row."""
    attempt = 1
    while True:
        ray = _RayStart(command, env)
        code = ray.wait()
        took = time.monotonic() - ray.began
        if code == 0:
            return ray, code, attempt
        if took < STARTUP_S:
            if attempt == START_ATTEMPTS:
                return ray, code, attempt
            attempt += 1
            what = f"ray start failed (exit code {code}: {ray.said or 'no message'}); "
            what += f"starting it again ({attempt} of {START_ATTEMPTS})"
        else:
            with contextlib.suppress(HarborHpcError):
                if node not in cluster.job_nodes(job_id):
                    return ray, code, attempt
            attempt = 1
            what = f"Ray ended after {took:.0f} s (exit code {code}: {ray.said or 'no message'})"
            what += "; joining the cluster again"
        print(f"harbor-hpc: {what}", file=sys.stderr, flush=True)
        _end_descendants()


def _start_head(
    command: list[str], env: dict[str, str], ray_dir: Path
) -> tuple[_RayStart, str, int]:
    """Start the head's Ray: its process, the cluster's address and the attempts it took. As a
    worker's, one whose `ray start` ended without an address within STARTUP_S (on a loaded node
    Ray's own start-up wait runs out: "The current node timed out during startup") starts again,
    up to START_ATTEMPTS times; after the last, `NoAddress` with Ray's last words."""
    attempt = 1
    while True:
        ray = _RayStart(command, env)
        try:
            return ray, wait_for_address(ray_dir / "ray_current_cluster", ray.process), attempt
        except NoAddress as exc:
            code = ray.wait()  # it ended: its last words are read
            if attempt == START_ATTEMPTS or time.monotonic() - ray.began >= STARTUP_S:
                said = ray.said or "no message; see the job log"
                raise NoAddress(f"{exc} ({attempt} attempt(s)): {said}") from None
        attempt += 1
        print(
            f"harbor-hpc: the head's ray start failed (exit code {code}: "
            f"{ray.said or 'no message'}); starting it again ({attempt} of {START_ATTEMPTS})",
            file=sys.stderr,
            flush=True,
        )
        _end_descendants()


def stop_ray(ray: subprocess.Popen[bytes]) -> None:
    """End `ray start` when it still runs: asked first, killed after STOP_S (Ray drains for up
    to 30 s: longer than Slurm's usual KillWait)."""
    if ray.poll() is None:
        ray.terminate()
        try:
            ray.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            ray.kill()


def _end_descendants() -> None:
    """Kill whatever of this node is left once Ray ended: adopted orphans included."""
    left = psutil.Process().children(recursive=True)
    for process in left:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(left, timeout=STOP_S)


def main(cluster_dir: Path, join: str | None, labels: str | None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    _adopt_orphans()
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
    ray_dir = temp_dir / "ray"
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
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    # Popen, not `core.proc.run` (bounded in time): Ray is this task's service, for the job's life.
    ray: _RayStart | None = None
    no_head = False
    try:
        if head:
            # No dashboard, and no autoscaler monitor: Slurm, not Ray, gives the cluster its
            # nodes (node states come from the GCS), and each costs the head CPU for the job's life.
            head_only = ("--head", "--port=0", "--include-dashboard=false", "--no-monitor")
            command = _ray_start(ray_dir, *head_only, *own)
            ray, address, attempts = _start_head(command, env, ray_dir)
            atomic_write_text(address_file(cluster_dir, job_id), address + "\n")
            code = ray.wait()
        else:
            address = join or wait_for_address(address_file(cluster_dir, job_id), None)
            command = _ray_start(ray_dir, f"--address={address}", *own)
            ray, code, attempts = _keep_joined(command, env, node, job_id)
        took = time.monotonic() - ray.began
        if code != 0 and took < STARTUP_S:  # it never got going: `ray up` names the node
            atomic_write_text(
                failure_file(cluster_dir, job_id, f"{node}-{os.environ.get('SLURM_PROCID', 0)}"),
                f"node {node}: ray start ended with exit code {code} after {took:.0f} s "
                f"({attempts} attempt(s)): {ray.said or 'no message; see the job log'}\n",
            )
        return code
    except NoAddress as exc:  # the head's ray start never had an address, however often tried
        atomic_write_text(failure_file(cluster_dir, job_id, f"{node}-0"), f"node {node}: {exc}\n")
        no_head = True
        return 1
    finally:
        # Ended by itself (not stopped), or never there: the workers have no cluster to join.
        ended = no_head or (ray is not None and ray.process.poll() is not None)
        if ray is not None and not _terminated.is_set():
            stop_ray(ray.process)
        # Told to end, Ray is not waited for (Slurm signalled every process of the node, and
        # Ray's drain outlasts KillWait): what is left is killed, so that the folder's removal
        # fits in the seconds before Slurm kills this process too, on a busy node as well.
        _end_descendants()
        private.remove()  # overlays hold files of the user's subordinate uids
        if head and ended:  # the job ends
            with contextlib.suppress(HarborHpcError):
                cluster.cancel(job_id)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m harbor_hpc.ray.node")
    parser.add_argument("cluster_dir", type=Path)
    parser.add_argument("--join", help="the address of a running cluster to join as workers")
    parser.add_argument("--labels", help="the node labels, key=value,...")
    arguments = parser.parse_args()
    sys.exit(main(arguments.cluster_dir, arguments.join, arguments.labels))
