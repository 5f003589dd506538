"""What only shows on several nodes, on the three-node cluster (`MultiNode`): a run's array
spread over the nodes, each trial's scratch on its own node's /tmp and gone from there after,
and Slurm's own address of a node, which Ray nodes advertise."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from harbor_hpc.slurm.cluster import parse_node_address
from tests.conftest import MultiNode
from tests.support.cli import cli_json
from tests.support.sample_tasks import make_task

SCONTROL_SHOW_NODE = (
    "NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=1.84 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=10.77.0.11 "
    "NodeHostName=n1 Version=22.05.8 RealMemory=7231 State=IDLE Partitions=multi\n"
)


def test_a_nodes_address_is_read_from_scontrol() -> None:
    assert parse_node_address(SCONTROL_SHOW_NODE) == "10.77.0.11"
    assert parse_node_address("NodeName=n1 NodeAddr=(null) State=IDLE") is None
    assert parse_node_address("") is None


def scratch_left(folder: Path) -> list[str]:
    """The environments' private folders of this user left in a node's /tmp."""
    return sorted(
        p.name for p in folder.glob("harbor-hpc-env-*") if p.lstat().st_uid == os.getuid()
    )


@pytest.mark.multinode
@pytest.mark.slurm
@pytest.mark.apptainer
def test_an_array_spreads_over_the_nodes_and_scratch_stays_on_each(
    multinode: MultiNode, multinode_sif: Path
) -> None:
    tasks = multinode.work / "tasks"
    for name in ("a", "b", "c"):
        make_task(tasks, name, image=str(multinode_sif))
    run_dir = multinode.work / "run"
    # Two CPUs an element: a node holds one, so the three run at once on three nodes.
    cli_json(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir), "--cpus", "2",
        "--executor", "slurm", "--wait", env=multinode.env,
    )  # fmt: skip

    status = cli_json("status", str(run_dir), env=multinode.env)
    assert [(s["task"], s["state"], s["reward"]) for s in status] == [
        ("a", "done", 1.0),
        ("b", "done", 1.0),
        ("c", "done", 1.0),
    ]
    # submitit logs the node each element ran on.
    logs = " ".join(p.read_text() for p in (run_dir / "submitit").glob("*/*_log.out"))
    assert set(re.findall(r"hostname=(\w+)", logs)) == {"n1", "n2", "n3"}, logs[:2000]
    # Each node's scratch was its own /tmp, and nothing of the trials is left there.
    assert {node: scratch_left(tmp) for node, tmp in multinode.node_tmp.items()} == {
        "n1": [],
        "n2": [],
        "n3": [],
    }
    trial = json.loads(next((run_dir / "trials").glob("*/result.json")).read_text())
    assert trial["exception_info"] is None
