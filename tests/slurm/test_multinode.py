"""What only shows on several nodes, on the three-node cluster (`MultiNode`): a run's array
spread over the nodes, each trial's scratch on its own node's /tmp and gone from there after,
Slurm's own address of a node, which Ray nodes advertise, a node that crashes under a run and
comes back, and images converted on the nodes into one shared store, each verified once on
each node that uses it."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import time
import uuid
from pathlib import Path

import pytest

from harbor_hpc.containers.store import is_ready
from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.slurm.cluster import parse_node_address
from harbor_hpc.tasks.manifest import ImageRecord, load_manifest
from tests.conftest import MultiNode
from tests.support.cli import cli_json
from tests.support.images import TINY_DOCKERFILE, write_manifest
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


@pytest.mark.multinode
@pytest.mark.slurm
@pytest.mark.apptainer
def test_a_node_that_crashes_under_a_run_loses_nothing_and_duplicates_nothing(
    faulty_nodes: MultiNode, multinode_sif: Path
) -> None:
    """A node dies with every process on it while its element runs a trial. Slurm sees the node
    gone and requeues the element; the node comes back; the element runs the trial again (a
    new trial name), and the run ends with each task once, done, the cut trial kept apart."""
    cluster = faulty_nodes
    tasks = cluster.work / "tasks"
    for name in ("a", "b", "c"):
        make_task(tasks, name, kind="lingering", image=str(multinode_sif))
    run_dir = cluster.work / "run"
    submitted = cli_json(
        "submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir), "--cpus", "2",
        "--executor", "slurm", env=cluster.env,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while len(RunTrials(run_dir, reward_key=None).markers) < 3:
        assert time.monotonic() < deadline, f"the trials never started: {submitted}"
        time.sleep(0.5)
    cut = next(m for m in RunTrials(run_dir, reward_key=None).markers if m.task == "b")
    assert cut.host in cluster.node_tmp and cut.job is not None
    cluster.node("crash", cut.host)

    # Slurm notices the node is gone (SlurmdTimeout) and requeues the element on it, which it
    # then holds for two minutes (its credentials' lifetime): the node comes back meanwhile.
    while "BeginTime" not in cluster.slurm("squeue", "-h", "-j", cut.job, "-o", "%T %r"):
        assert time.monotonic() < deadline + 120, cluster.slurm("squeue", "-j", cut.job)
        time.sleep(1)
    cluster.node("start", cut.host)
    # What is tested is what happens after the hold (tests/slurm/test_runs.py lifts it so too,
    # two seconds on: a credential of the same second as the revoked one counts as revoked).
    time.sleep(2)
    cluster.slurm("scontrol", "update", f"JobId={cut.job}", "StartTime=now")
    while cluster.slurm("squeue", "-h", "-u", str(os.getuid()), "-o", "%i").strip():
        assert time.monotonic() < deadline + 400, cluster.slurm("squeue")
        time.sleep(1)

    status = cli_json("status", str(run_dir), env=cluster.env)
    assert [(s["task"], s["state"], s["reward"]) for s in status] == [
        ("a", "done", 1.0),
        ("b", "done", 1.0),
        ("c", "done", 1.0),
    ]
    markers = RunTrials(run_dir, reward_key=None).markers
    assert sorted(m.task for m in markers) == ["a", "b", "b", "c"]  # b cut once, run again
    assert cut.trial not in {s["trial"] for s in status}
    out = cluster.work / "rollouts.jsonl"
    cli_json("export", str(run_dir), "--out", str(out), env=cluster.env)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["task"] for line in lines if line["counts"]) == ["a", "b", "c"]
    # The trial the lost node cut, if it left a result: the cluster's, never trainable.
    for line in lines:
        if line["trial"] == cut.trial:
            assert (line["failure"], line["trainable"]) == ("infrastructure", False), line
    assert all(line["trainable"] and line["group_trainable"] for line in lines if line["counts"])


def push_tiny_images(count: int) -> list[str]:
    """`count` distinct tiny images in the open registry: their pinned references."""
    import docker

    client = docker.from_env()
    base = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    repository = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/harbor-hpc-test/spread"
    refs = []
    for _ in range(count):
        nonce = uuid.uuid4().hex[:12]
        dockerfile = TINY_DOCKERFILE.format(base=base, nonce=nonce).encode()
        image, _ = client.images.build(fileobj=io.BytesIO(dockerfile), tag=f"{repository}:{nonce}")
        digest = None
        for line in client.images.push(repository, tag=nonce, stream=True, decode=True):
            assert "error" not in line, line
            digest = line.get("aux", {}).get("Digest", digest)
        client.images.remove(image.id, force=True)
        refs.append(f"{repository}@{digest}")
    client.close()
    return refs


# On each node: every .sif made ready to run there, as environments do before they start.
CHECK = (
    "import sys, pathlib; from harbor_hpc.containers.store import checked_sif\n"
    "for sif in sys.argv[1:]: checked_sif(pathlib.Path(sif))"
)


@pytest.mark.multinode
@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_images_convert_on_the_nodes_into_one_store_and_each_node_verifies_them_once(
    multinode: MultiNode,
) -> None:
    refs = push_tiny_images(3)
    manifest = multinode.work / "manifest.json"
    images = {}
    for i, ref in enumerate(refs):
        repository, digest = ref.split("@")
        images[f"ctx{i}"] = ImageRecord(
            repository=repository, tag="t", digest=digest, tasks=[f"t/{i}"]
        )
    write_manifest(manifest, images)

    def records() -> dict[str, dict[str, int]]:
        """Each node's records of the .sifs this user verified there, and their times."""
        found = {}
        for node, tmp in multinode.node_tmp.items():
            folder = tmp / f"harbor-hpc-{os.getuid()}" / "verified"
            found[node] = {p.name: p.stat().st_mtime_ns for p in folder.glob("*")}
        return found

    before = records()  # (the node that converts an image has verified it there)
    store = multinode.work / "store"
    converted = cli_json(
        "convert", "--manifest", str(manifest), "--cache-dir", str(store), "--slurm",
        "--partition", "multi", "--time", "10", "--mem", "1024", env=multinode.env,
    )  # fmt: skip
    assert (converted["converted"], converted["failed"]) == (3, 0), converted
    # Two CPUs an element: one a node, all three at once, each writing into the one store.
    logs = " ".join(p.read_text() for p in (store / ".slurm").glob("*/*_log.out"))
    assert set(re.findall(r"hostname=(\w+)", logs)) == {"n1", "n2", "n3"}, logs[:2000]
    sifs = sorted(Path(image.sif or "") for image in load_manifest(manifest).images.values())
    assert all(is_ready(sif) for sif in sifs) and len(set(sifs)) == 3
    assert sorted(p.name for p in store.iterdir() if p.suffix == ".sif") == [s.name for s in sifs]

    check = ["srun", "-N3", "-n3", "-p", "multi", "-t", "5", sys.executable, "-c", CHECK]
    multinode.slurm(*check, *map(str, sifs))
    first = records()
    for node in multinode.node_tmp:
        assert len(set(first[node]) - set(before[node])) == 3, (node, first, before)
    # A second use on the same nodes hashes nothing again: the records stand as they were.
    multinode.slurm(*check, *map(str, sifs))
    assert records() == first


@pytest.mark.multinode
@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_contexts_build_on_the_nodes_into_one_store(multinode: MultiNode, base_image: str) -> None:
    """`build --slurm`: three contexts, one array element each (two CPUs: one a node), built by
    Apptainer on three nodes at once into the one shared store, the base image pulled from the
    registry on each node."""
    tasks = multinode.work / "tasks"
    token = uuid.uuid4().hex[:10]
    for name in ("a", "b", "c"):
        task = make_task(tasks, name, image=None)
        dockerfile = f"FROM {base_image}\nRUN echo {token}-{name} > /built\n"
        (task / "environment" / "Dockerfile").write_text(dockerfile)
    store, manifest = multinode.work / "store", multinode.work / "manifest.json"
    built = cli_json(
        "build", str(tasks), "--builder", "apptainer", "--slurm", "--partition", "multi",
        "--cache-dir", str(store), "--manifest", str(manifest), "--time", "20", "--mem", "4096",
        env=multinode.env,
    )  # fmt: skip
    assert [image["action"] for image in built["images"]] == ["built into the store"] * 3
    logs = " ".join(p.read_text() for p in (store / ".slurm").glob("*/*_log.out"))
    assert set(re.findall(r"hostname=(\w+)", logs)) == {"n1", "n2", "n3"}, logs[:2000]
    records = load_manifest(manifest)
    sifs = set()
    for name in ("a", "b", "c"):
        record = records.image_of(name)
        assert record is not None and record.sif and is_ready(Path(record.sif)), name
        sifs.add(record.sif)
    assert len(sifs) == 3
