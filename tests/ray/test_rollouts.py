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
from tests.e2e.test_secrets import SECRET, policy_server, rollouts_with_the_key
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


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.docker
def test_the_model_servers_key_stays_out_of_containers_on_ray_nodes(
    ray_cluster: RayCluster, debian_sif: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """tests/e2e/test_secrets.py's rollout, its container on a Ray node."""
    with policy_server(monkeypatch) as llm:
        monkeypatch.setenv("OPENAI_API_KEY", SECRET)
        rollouts_with_the_key(
            llm, debian_sif, tmp_path, executor="ray",
            environment_kwargs={"ray_cluster_dir": ray_cluster["cluster_dir"], "ray_cpus": 0.5},
        )  # fmt: skip


# The trainer of the test below, in a process of its own: a Ray driver is ended by Ray when
# its cluster goes (the module's cluster, at the module's end), which pytest's worker must not be.
_TRAINER = """
import json, sys, time
from harbor_hpc.api import SandboxOptions, SandboxPool
from harbor_hpc.trl import HarborBashEnv

task, cluster_dir = sys.argv[1], sys.argv[2]
kwargs = {"ray_cluster_dir": cluster_dir, "ray_cpus": 1}
said = {}
with SandboxPool(SandboxOptions(executor="ray", environment_kwargs=kwargs)) as pool:
    held = [pool.open(task) for _ in range(2)]
    said["held"] = [sandbox.exec("hostname").return_code for sandbox in held]
    third = pool.open(task)
    deadline = time.monotonic() + 60
    while third.waiting is None and time.monotonic() < deadline:
        time.sleep(0.5)
    said["waiting"] = third.waiting
    held[0].exec("echo 42 > /tmp/answer")
    said["first"] = held[0].verify().training_reward  # its node is free again
    third.exec("echo 42 > /tmp/answer")
    said["third"] = third.verify().training_reward
    held[1].close()
env = HarborBashEnv(executor="ray", environment_kwargs={**kwargs, "ray_cpus": 0.5})
env.reset(task_dir=task)
env.bash("echo 42 > /tmp/answer")
said["trl"] = env.get_reward()
print(json.dumps(said), flush=True)
"""


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.trl
def test_trainers_sandboxes_on_the_ray_cluster_and_one_that_waits_for_room_says_so(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    """The sandbox API and TRL's HarborEnv (harbor_hpc.trl) with executor ray: two sandboxes
    of a whole CPU hold both Ray nodes, a third waits for room and says so until one is done."""
    import subprocess
    import sys

    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    ran = subprocess.run(
        [sys.executable, "-c", _TRAINER, str(task), str(ray_cluster["cluster_dir"])],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = json.loads(ran.stdout.strip().splitlines()[-1])
    assert said["held"] == [0, 0]
    assert (said["waiting"] or "").startswith("waiting for a Ray node with room for 1 CPU")
    assert (said["first"], said["third"], said["trl"]) == (1.0, 1.0, 1.0)
