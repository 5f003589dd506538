"""This process as a Ray driver of the cluster its environments run on.

Which cluster: one this process already joined (a trainer's: `ray.init` was called), else the
`ray_address` given, else the one `harbor-hpc ray up` started (its folder's `cluster.json`),
else $RAY_ADDRESS. With `ray up`'s cluster comes its token file; with another address, the
token settings already in the environment (RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH, set
before Ray is first imported: Ray reads them once).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from pathlib import Path

import psutil

from harbor_hpc.containers.errors import EnvironmentHostUnavailable
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.ray import local_node
from harbor_hpc.ray.cluster import (
    INSTALL_HINT,
    alive_node_ips,
    default_cluster_dir,
    load,
    ray_missing,
)
from harbor_hpc.ray.node import use_token

_lock = threading.Lock()
# How long the check before a batch waits for the cluster's answer (a wrong address otherwise
# costs every environment its own wait, one after the other).
CHECK_TIMEOUT_S = 20.0


def cluster_address(ray_address: str | None, cluster_dir: Path | None) -> tuple[str, Path | None]:
    """The address to join, and the `ray up` folder whose token goes with it (None: the
    environment's own token settings)."""
    folder = cluster_dir or default_cluster_dir()
    cluster = load(folder) if (folder / "cluster.json").exists() else None
    if ray_address:
        same = cluster is not None and cluster.address == ray_address
        return ray_address, folder if same else None
    if cluster is not None:
        return cluster.address, folder
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], None
    raise EnvironmentHostUnavailable(
        f"no Ray cluster to run environments on: none in {folder} and no RAY_ADDRESS; start "
        "one with `harbor-hpc ray up` (or, where it was, ended: up again), or pass the "
        "environment kwarg ray_cluster_dir (the folder `ray up --cluster-dir` used) or "
        "ray_address"
    )


def cluster_problem(
    ray_address: str | None, cluster_dir: Path | None, *, timeout_s: float = CHECK_TIMEOUT_S
) -> str | None:
    """Why environments could not run on the cluster they would join (none to join, no answer
    within `timeout_s`, no node alive), or None when it answers. Asked of its GCS, without
    joining it: nothing of Ray's starts in this process, nothing is printed."""
    try:
        address, token_dir = cluster_address(ray_address, cluster_dir)
    except EnvironmentHostUnavailable as exc:
        return str(exc)
    host, _, port = address.rpartition(":")
    try:  # nothing there at all is known at once, without Ray's own retries and warnings
        socket.create_connection((host, int(port)), timeout=min(timeout_s, 5)).close()
    except ValueError:
        return f"{address} is not a Ray cluster's address (HOST:PORT)"
    except OSError as exc:
        return f"nothing answers at the Ray cluster's address {address} ({exc.strerror or exc})"
    answer: dict[str, set[str] | str] = {}

    def ask() -> None:
        try:
            answer["nodes"] = alive_node_ips(address, token_dir)
        except HarborHpcError as exc:
            answer["error"] = f"{exc.message} ({exc.hint})" if exc.hint else exc.message

    asking = threading.Thread(target=ask, name="ray-cluster-check", daemon=True)
    asking.start()
    asking.join(timeout_s)
    if asking.is_alive():
        return f"the Ray cluster at {address} did not answer within {timeout_s:.0f} s"
    if "error" in answer:
        return str(answer["error"])
    if not answer["nodes"]:
        return f"the Ray cluster at {address} has no node alive"
    return None


def connect(ray_address: str | None, cluster_dir: Path | None) -> None:
    """Join the cluster once per process (a no-op once joined, whoever joined it)."""
    problem = ray_missing()
    if problem:
        raise EnvironmentHostUnavailable(f"{problem}: {INSTALL_HINT}")
    with _lock:
        joined = sys.modules.get("ray")
        if joined is not None and joined.is_initialized():
            return
        address, token_dir = cluster_address(ray_address, cluster_dir)
        if token_dir is not None:
            use_token(os.environ, token_dir)
        # Ray starts the workers of a driver run by `uv run` (or below one) through `uv run`
        # too, in a new virtualenv made from a copy of the driver's folder: without the ray
        # extra unless it was named (a host that never starts), from the package index (which
        # compute nodes often cannot reach). The hosts run in the Python their nodes run.
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        import ray  # after these settings: Ray reads them when first imported

        try:
            node_ip = _node_of_this_machine(address)
        except HarborHpcError as exc:  # the cluster does not answer
            raise EnvironmentHostUnavailable(exc.message) from None
        except (OSError, RuntimeError) as exc:  # this machine's node did not join
            raise EnvironmentHostUnavailable(f"the Ray cluster at {address}: {exc}") from None
        try:
            # The hosts' logs stay on their nodes (Ray's log folder there): a driver serving
            # hundreds of environments must not spend its time relaying them.
            ray.init(
                address=address,
                _node_ip_address=node_ip,
                logging_level=logging.ERROR,
                log_to_driver=False,
            )
        except Exception as exc:  # Ray raises its own connection and authentication errors
            raise EnvironmentHostUnavailable(
                f"the Ray cluster at {address} does not answer: {' '.join(str(exc).split())[:300]}"
            ) from None


def _node_of_this_machine(address: str) -> str | None:
    """The address of this machine's Ray node of the cluster: None where one of the cluster's
    nodes runs here (Ray finds it), else one started for this driver (`local_node`)."""
    here = {
        entry.address
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family == socket.AF_INET
    }
    if alive_node_ips(address) & here:
        return None
    ip = local_node.route_to(address)
    local_node.start(address, ip, lambda: alive_node_ips(address))
    return ip
