"""A trainer in a pyxis container (`srun --container-image=...`, issue 57): from inside it,
`run_rollouts` queues Slurm arrays (whose trials run on the nodes, outside the trainer's
container) and runs local rollouts and sandboxes of the API in enroot containers of its own,
nested in the trainer's, as an ordinary user. What a site must allow: docs/environment.md,
"Trainers in pyxis containers".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_hpc.runtimes.enroot import find_enroot
from tests.support.images import build_trainer_sqsh
from tests.support.sample_tasks import make_task

pytestmark = [
    pytest.mark.pyxis,
    pytest.mark.enroot,
    pytest.mark.slurm,
    pytest.mark.apptainer,
    pytest.mark.docker,
]

REPO = Path(__file__).resolve().parents[2]

# The trainer: one batch on each executor, then a sandbox of the API, each said as a JSON line.
TRAINER = """\
import json, sys
from pathlib import Path
from harbor_hpc.api import RolloutRequest, SandboxOptions, SandboxPool, run_rollouts

tasks, run_dir, partition = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
for executor in ("slurm", "local"):
    lines = run_rollouts(RolloutRequest(
        tasks=tasks, run_dir=run_dir / executor, agent="oracle", executor=executor,
        partition=partition if executor == "slurm" else None,
    ))
    print(json.dumps({executor: sorted([l["task"], l["reward"], l["trainable"]] for l in lines)}))
pool = SandboxPool(SandboxOptions(executor="local"))
for answer in ("42", "41"):
    box = pool.open(str(tasks / "a"))
    ran = box.exec(f"id -u; echo {answer} > /tmp/answer")
    result = box.verify()
    print(json.dumps({"sandbox": [answer, ran.stdout.strip(), result.reward, result.trainable]}))
    box.close()
pool.close()
"""


@pytest.fixture(scope="module")
def trainer_sqsh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_trainer_sqsh(tmp_path_factory.mktemp("pyxis") / "trainer.sqsh", os.environ)


def test_a_trainer_in_a_pyxis_container_runs_rollouts_and_sandboxes(
    trainer_sqsh: Path, debian_sif: Path, tmp_path: Path
) -> None:
    for name in ("a", "b"):
        make_task(tmp_path / "tasks", name, image=str(debian_sif))
    (tmp_path / "trainer.py").write_text(TRAINER)
    enroot = find_enroot()
    assert enroot is not None
    # What the trainer reads, at the paths it has on the node: the checkout and its venv's
    # Python, the run's folder, Slurm's configuration, munge's socket, and the folder of enroot
    # and pyxis (the plug-in plugstack.conf names, which sbatch loads there too).
    mounts = [
        REPO,
        Path(sys.base_prefix),
        tmp_path,
        debian_sif.parent,
        Path("/etc/slurm"),
        Path("/run/munge"),
        Path(enroot).resolve().parents[1],
    ]
    partition = os.environ.get("HARBOR_HPC_TEST_SLURM_PARTITION", "debug")
    ran = subprocess.run(
        [
            "srun", "-p", partition, "--time=10",
            f"--container-image={trainer_sqsh}",
            "--container-mounts=" + ",".join(f"{path}:{path}" for path in dict.fromkeys(mounts)),
            f"--container-workdir={tmp_path}",
            "--container-env=PATH",  # enroot's folder on it, as a `module load` puts it
            sys.executable, str(tmp_path / "trainer.py"),
            str(tmp_path / "tasks"), str(tmp_path / "runs"), partition,
        ],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    said: dict[str, list[object]] = {}
    for line in ran.stdout.splitlines():
        if line.startswith("{"):
            for key, value in json.loads(line).items():
                said.setdefault(key, []).append(value)
    expected = [["a", 1.0, True], ["b", 1.0, True]]
    assert said["slurm"] == [expected] and said["local"] == [expected], ran.stdout
    # Root in the sandbox, and the verifier's reward the policy's, right and wrong alike.
    assert said["sandbox"] == [["42", "0", 1.0, True], ["41", "0", 0.0, True]], ran.stdout
    # The Slurm trials ran on the node, outside the trainer's container; the local ones in it.
    slurm_logs = list((tmp_path / "runs" / "slurm").rglob("trial.log"))
    local_logs = list((tmp_path / "runs" / "local").rglob("trial.log"))
    assert len(slurm_logs) == len(local_logs) == 2
    assert all("started by enroot" in log.read_text() for log in local_logs)
