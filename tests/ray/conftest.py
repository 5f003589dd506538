"""The Ray clusters the tests run environments on: `harbor-hpc ray up` on the real Slurm, as
the ordinary test user, two Ray nodes on this one machine (each its own node id, raylet and
temporary folder), so that environments really run in another process tree than the driver's."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import cli

RayCluster = dict[str, Any]


def ray_up(cluster_dir: Path, *options: str) -> RayCluster:
    """A two-node cluster in `cluster_dir`; `up`'s --json (address, job_id, token_file...)."""
    up = cli(
        "ray", "up", "--nodes", "1", "--ray-nodes-per-node", "2", "--cpus-per-node", "1",
        "--time", "30", "--wait-timeout", "120", "--cluster-dir", str(cluster_dir), "--json",
        *options,
    )  # fmt: skip
    cluster: RayCluster = json.loads(up.stdout)
    return cluster


def ray_down(cluster_dir: Path) -> None:
    if (cluster_dir / "cluster.json").exists():
        cli("ray", "down", "--cluster-dir", str(cluster_dir), check=False)


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """One cluster for the module's tests that only use it (a test that breaks a cluster makes
    its own with `own_ray_cluster`). Not the session's: the cluster holds the machine's two
    Slurm CPUs, which the Slurm tests after the module need."""
    cluster_dir = tmp_path_factory.mktemp("ray-shared") / "cluster"
    cluster = ray_up(cluster_dir)
    yield cluster
    ray_down(cluster_dir)


@pytest.fixture
def own_ray_cluster(tmp_path: Path) -> Iterator[Callable[..., RayCluster]]:
    """Start a cluster of the test's own (`own_ray_cluster(*ray_up_options)`), ended after it."""
    started: list[Path] = []

    def start(*options: str) -> RayCluster:
        cluster_dir = tmp_path / f"cluster-{len(started)}"
        started.append(cluster_dir)
        return ray_up(cluster_dir, *options)

    yield start
    for cluster_dir in started:
        ray_down(cluster_dir)
