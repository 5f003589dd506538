"""A Ray node of no resources beside a driver whose machine runs none of the cluster's nodes.

Ray drivers talk to a raylet of their own machine: a trainer on a login node, or on GPU nodes
outside the cluster of `ray up`, has none, and `ray.init` would end its process. `start` gives
it one (`ray start --num-cpus=0 --num-gpus=0`, so that nothing is placed there), at the address
this machine reaches the cluster from, with its files in a private temporary folder. The node
is tied to the driver: when the driver ends, however it ends, the node ends and its folder goes
(`python -m harbor_hpc.ray.local_node ADDRESS IP DRIVER_PID` is that node's keeper, a child of
the driver that watches it is still its parent). Not by a pipe from the driver: the driver's
end is an fd among those of Ray's and gRPC's threads, and a node in CI was stopped 2 s after it
joined, under a live driver, by nothing else than its keeper reading that pipe as closed. What
`ray start` prints (its banner) goes to a log in that folder, never to the driver's stdout (a
trainer's may be JSON lines); the log's tail goes to stderr should the node fail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from harbor_hpc.core.scratch import PrivateDir
from harbor_hpc.ray.node import stop_ray

# How long the node may take to join before the driver gives up.
JOIN_TIMEOUT_S = 60.0
# How often a keeper looks whether its driver still runs.
WATCH_S = 0.5
# The keepers of this process's nodes.
_keepers: list[subprocess.Popen[bytes]] = []


def route_to(address: str) -> str:
    """This machine's IPv4 address towards `address` (HOST:PORT): the one the cluster's nodes
    reach it at (no packet is sent)."""
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, int(port)))
        return str(probe.getsockname()[0])


def start(address: str, ip: str, alive: Callable[[], set[str]]) -> None:
    """Start this machine's node of the cluster at `address`, at `ip`, and wait until `alive()`
    (the cluster's alive node addresses) counts it; a RuntimeError says why it did not join."""
    keeper = subprocess.Popen(
        [sys.executable, "-m", "harbor_hpc.ray.local_node", address, ip, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C at the driver's terminal: the driver's end, then its
    )
    _keepers.append(keeper)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while ip not in alive():
        if keeper.poll() is not None:
            raise RuntimeError(f"a Ray node of this machine ({ip}) could not start")
        if time.monotonic() > deadline:
            raise RuntimeError(f"a Ray node of this machine ({ip}) did not join within 60 s")
        time.sleep(0.5)


def main(address: str, ip: str, driver: int) -> int:
    private = PrivateDir("harbor-hpc-ray-driver-")
    env = dict(os.environ, RAY_TMPDIR=str(private.path))
    log_path = private.path / "ray-start.log"
    log = log_path.open("wb")
    ray = subprocess.Popen(
        [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
            f"--address={address}", f"--node-ip-address={ip}", "--num-cpus=0",
            f"--temp-dir={private.path / 'ray'}",  # not the head's folder's path, here
            "--num-gpus=0", "--disable-usage-stats",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip

    driver_gone = threading.Event()

    def watch() -> None:
        while os.getppid() == driver:  # once the driver ended, another process adopted this one
            time.sleep(WATCH_S)
        driver_gone.set()
        ray.terminate()

    threading.Thread(target=watch, daemon=True).start()
    try:
        code = ray.wait()
        if not driver_gone.is_set():  # Ray ends with 1 when stopped: only its own end is news
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            sys.stderr.write(f"ray start ({ip}) ended with {code}:\n" + "\n".join(tail) + "\n")
        return code
    finally:
        stop_ray(ray)
        log.close()
        private.remove()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
