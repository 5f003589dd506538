"""The wheel carries every file of `templates/`, `slurm/` and `manifests/` (as
`harbor_hpc/_<folder>`), and the package installed from it finds them there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("templates", "slurm", "manifests")

# Run from the unpacked wheel: a file of each folder as the one lookup finds it, and a render.
FIND = """
from harbor_hpc.core.templates import render_template, template_path
for folder, name in [("templates", "setup.sh"), ("slurm", "ray_job.sh"),
                     ("manifests", "manifest.schema.json")]:
    print(template_path(name, folder))
print(render_template("array_setup.sh", {"setup": "module load apptainer"}, "slurm"))
"""


def test_the_wheel_ships_the_folders_the_code_reads(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    dist, unpacked = tmp_path / "dist", tmp_path / "wheel"
    built = subprocess.run(
        [uv, "build", "--wheel", "--out-dir", str(dist), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    [wheel] = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
        archive.extractall(unpacked)
    for folder in FOLDERS:
        files = [path for path in (REPO / folder).rglob("*") if path.is_file()]
        assert files, folder
        for path in files:
            if "__pycache__" not in path.parts:
                assert f"harbor_hpc/_{folder}/{path.relative_to(REPO / folder)}" in shipped

    found = subprocess.run(
        [sys.executable, "-c", FIND],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(unpacked)},
        cwd=tmp_path,
        check=True,
    )
    *paths, rendered = found.stdout.split("\n", 3)
    assert [Path(path).parent for path in paths] == [
        unpacked / "harbor_hpc" / f"_{folder}" for folder in FOLDERS
    ]
    assert "\nmodule load apptainer\n" in rendered
