"""What the Slurm run tests share: a .sif of the test base image, built once per session,
and a way to call the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harbor_hpc.apptainer.runtime import find_apptainer


@pytest.fixture(scope="session")
def debian_sif(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test base image (python3 included) as a .sif, from the local Docker daemon."""
    base = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    sif = tmp_path_factory.mktemp("sif") / "debian.sif"
    subprocess.run(
        [find_apptainer(), "build", str(sif), f"docker-daemon://{base}"],
        check=True,
        capture_output=True,
    )
    return sif


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `harbor-hpc ARGS` as users do, in this Python."""
    result = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args], capture_output=True, text=True, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"harbor-hpc {' '.join(args)} failed:\n{result.stderr}")
    return result


def cli_json(*args: str) -> Any:
    return json.loads(cli(*args, "--json").stdout)
