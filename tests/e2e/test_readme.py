"""The README, run as written: its quick start without Docker, its one-minute trial without
Slurm and its scripted terminus-2 run (the `bash` blocks of those sections, in order, in one
shell, in a fresh folder holding a copy of `examples/`), as an ordinary user whom no Docker
Engine answers.

Two things are added, as a lab would for this machine: a `harbor-hpc.toml` naming the base image
(CI has no Docker Hub, so the examples' public base cannot be pulled; the README says to name
another), and a free port for the scripted model instead of 8000.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = (
    "## Quick start, without Docker",
    "## One trial in a minute, without Slurm",
    "## terminus-2 against your model",
)


def bash_blocks(readme: str, heading: str) -> list[str]:
    section = readme.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```bash\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.docker  # test setup pushes the base image into the registry with Docker
@pytest.mark.registry
@pytest.mark.apptainer
@pytest.mark.slurm
@pytest.mark.apptainer_only  # Apptainer builds the Dockerfile (no Docker)
def test_the_readme_runs_as_written_without_docker(base_image: str, tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    blocks = [block for heading in SECTIONS for block in bash_blocks(readme, heading)]
    assert len(blocks) == 3, "the README's runnable sections changed: update this test"
    port = free_port()
    script = "\n".join(blocks).replace(":8000", f":{port}").replace("port 8000", f"port {port}")

    work = tmp_path / "readme"
    work.mkdir()
    shutil.copytree(REPO / "examples", work / "examples")
    (work / "harbor-hpc.toml").write_text(f'build_args = ["BASE_IMAGE={base_image}"]\n')
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "DOCKER_HOST": f"unix://{tmp_path / 'no-docker.sock'}",  # no Docker Engine answers
        "PYTHONPATH": str(REPO),  # `python -m tests.support.scripted_llm`, from a checkout
    }
    # A block that fails leaves no background job (the scripted model) holding our pipes.
    script = "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=work, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    said = done.stdout + done.stderr
    assert done.returncode == 0, said

    # Quick start: two .sif files for three tasks, a reward of 1 each, an export of yours only.
    manifest = json.loads((work / "manifest.json").read_text())
    sifs = {Path(record["sif"]) for record in manifest["images"].values()}
    assert len(sifs) == 2 and all(sif.parent == work / "sif" and sif.is_file() for sif in sifs)
    rollouts = [json.loads(line) for line in (work / "rollouts.jsonl").read_text().splitlines()]
    assert sorted((r["task"], r["reward"]) for r in rollouts) == [
        ("fix-python", 1.0),
        ("hello-world", 1.0),
        ("word-count", 1.0),
    ]
    assert stat.S_IMODE((work / "rollouts.jsonl").stat().st_mode) == 0o600
    # The one-minute trial, through Harbor's own command line.
    (result,) = (work / "trials").glob("*/result.json")
    assert json.loads(result.read_text())["verifier_result"]["rewards"]["reward"] == 1.0
    # terminus-2 against the scripted model: both attempts solved, the policy's tokens exported.
    lines = [json.loads(line) for line in (work / "rl.jsonl").read_text().splitlines()]
    assert [(line["task"], line["reward"]) for line in lines] == [("hello-world", 1.0)] * 2, said
    for line in lines:
        assert len(line["token_ids"]) == len(line["mask_ids"]) == len(line["logprobs"])
        assert sum(line["mask_ids"]) > 0
