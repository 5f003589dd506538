"""`run_rollouts(executor="ray")`: the trainer's one call, its containers on a Ray cluster's
nodes, with a run folder like any other; a cluster that does not answer is named once, before
the batch."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from harbor_hpc.api import InputError, Progress, RolloutRequest, run_rollouts, run_status
from tests.ray.conftest import RayCluster
from tests.support.sample_tasks import make_task

pytestmark = [pytest.mark.ray]


def test_a_ray_cluster_that_does_not_answer_is_raised_once_before_the_batch(
    tmp_path: Path,
) -> None:
    image = tmp_path / "answer.sif"
    image.write_bytes(b"")  # only its presence is asked before anything runs
    for name in ("one", "two", "three"):
        make_task(tmp_path / "tasks", name, image=str(image))
    with socket.socket() as probe:  # an address nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    request = RolloutRequest(
        tasks=tmp_path / "tasks",
        run_dir=tmp_path / "run",
        agent="oracle",
        executor="ray",
        environment_kwargs={"ray_address": address},
    )
    began = time.monotonic()
    with pytest.raises(
        InputError, match=f"nothing answers at the Ray cluster's address {address}"
    ) as raised:
        run_rollouts(request)
    assert time.monotonic() - began < 15  # at once, not once per environment after its wait
    assert raised.value.hint is not None and "environment_kwargs ray_address" in raised.value.hint
    assert not (tmp_path / "run" / "run.json").exists()


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.docker
def test_rollouts_on_the_ray_cluster_are_a_run_like_any_other(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    for name in ("one", "two"):
        make_task(tmp_path / "tasks", name, image=str(debian_sif))
    run_dir = tmp_path / "run"
    lines = run_rollouts(
        RolloutRequest(
            tasks=tmp_path / "tasks",
            run_dir=run_dir,
            agent="oracle",
            executor="ray",
            environment_kwargs={"ray_cluster_dir": ray_cluster["cluster_dir"], "ray_cpus": 0.5},
            concurrency=2,
        )
    )
    assert sorted((line["task"], line["reward"], line["trainable"]) for line in lines) == [
        ("one", 1.0, True),
        ("two", 1.0, True),
    ]
    # Nothing of Ray's on the caller's stdout: its driver is the run's worker, not the caller.
    assert capfd.readouterr().out == ""
    assert [s.state for s in run_status(run_dir).attempts] == ["done", "done"]
    config = json.loads((Path(lines[0]["trial_dir"]) / "config.json").read_text())
    assert config["environment"]["import_path"] == (
        "harbor_hpc.environment:RaySingularityEnvironment"
    )


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.docker
def test_progress_says_when_trials_wait_for_a_ray_node_with_room(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    """Three trials at once on two Ray nodes of one CPU, a whole CPU each: the third waits
    for room, which progress says (it read `running=3` and nothing else)."""
    for name in ("one", "two", "three"):
        make_task(tmp_path / "tasks", name, kind="pausing", image=str(debian_sif))
    seen: list[Progress] = []
    lines = run_rollouts(
        RolloutRequest(
            tasks=tmp_path / "tasks",
            run_dir=tmp_path / "run",
            agent="oracle",
            executor="ray",
            environment_kwargs={"ray_cluster_dir": ray_cluster["cluster_dir"], "ray_cpus": 1},
            concurrency=3,
        ),
        progress=seen.append,
    )
    assert sorted(line["reward"] for line in lines) == [1.0, 1.0, 1.0]
    said = {progress.waiting for progress in seen if progress.waiting}
    assert "waiting for a Ray node with room for 1 CPU, 512 MB (1)" in said, seen
