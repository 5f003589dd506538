from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.images.setup_sh import (
    SetupRequest,
    check_wheels,
    render_setup_sh,
    write_setup_scripts,
)


def make_task(root: Path, rel: str, dockerfile: str, files: dict[str, str]) -> Path:
    env = root / rel / "environment"
    env.mkdir(parents=True)
    (root / rel / "task.toml").write_text("[environment]\n")
    (env / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        (env / name).parent.mkdir(parents=True, exist_ok=True)
        (env / name).write_text(text)
    return env


def add_archive(env: Path, name: str, members: dict[str, str]) -> None:
    with tarfile.open(env / name, "w:gz") as archive:
        for member, text in members.items():
            info = tarfile.TarInfo(member)
            info.size = len(text.encode())
            archive.addfile(info, io.BytesIO(text.encode()))


def run_script(script: Path, staging: Path, python: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HARBOR_STAGING": str(staging), "HARBOR_PYTHON": str(python)}
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)


def fake_python_with_server_deps(tmp_path: Path) -> Path:
    """Stands in for a Python where uvicorn and fastapi import: every call succeeds."""
    python = tmp_path / "python-with-deps"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    return python


def test_rendered_script_is_valid_bash() -> None:
    for lines in ([], ["replay_file a.txt /x file '' ''"]):
        result = subprocess.run(["bash", "-n"], input=render_setup_sh(lines), text=True)
        assert result.returncode == 0


def test_replayed_copies_land_where_docker_puts_them(tmp_path: Path) -> None:
    dest = tmp_path / "image"
    env = make_task(
        tmp_path / "tasks",
        "t",
        f"FROM base AS b\nWORKDIR {dest}/app\nCOPY app.py ./\nCOPY conf conf\n"
        f"ADD data.tgz {dest}/data/\nCOPY --chmod=700 app.py {dest}/renamed.py\n"
        f"FROM b\nCOPY files/keep.txt {dest}/\n",
        {
            "app.py": "print(1)\n",
            "conf/a.ini": "a=1\n",
            "conf/skip.tmp": "ignored\n",
            ".dockerignore": "**/*.tmp\n",
            "files/keep.txt": "kept\n",
        },
    )
    add_archive(env, "data.tgz", {"inner/x.txt": "x\n"})
    result = write_setup_scripts(SetupRequest(tmp_path / "tasks", replay_copy=True))
    assert result.written == ["t"] and result.problems == []
    staged = env / "files"
    assert (staged / "_replay" / "conf" / "a.ini").is_file()
    assert not (staged / "_replay" / "conf" / "skip.tmp").exists()

    python = fake_python_with_server_deps(tmp_path)
    for _ in range(2):  # idempotent
        run = run_script(staged / "setup.sh", staged, python)
        assert run.returncode == 0, run.stderr
    assert (dest / "app" / "app.py").read_text() == "print(1)\n"
    assert (dest / "app" / "conf" / "a.ini").read_text() == "a=1\n"
    assert not (dest / "app" / "conf" / "skip.tmp").exists()
    assert (dest / "data" / "inner" / "x.txt").read_text() == "x\n"
    assert (dest / "renamed.py").stat().st_mode & 0o777 == 0o700
    assert (dest / "keep.txt").read_text() == "kept\n"


def test_existing_setup_sh_is_kept_unless_forced(tmp_path: Path) -> None:
    env = make_task(tmp_path / "tasks", "t", "FROM base\n", {"files/setup.sh": "echo mine\n"})
    result = write_setup_scripts(SetupRequest(tmp_path / "tasks"))
    assert result.kept == ["t"] and result.written == []
    assert (env / "files" / "setup.sh").read_text() == "echo mine\n"
    assert write_setup_scripts(
        SetupRequest(tmp_path / "tasks", dry_run=True, force=True)
    ).written == ["t"]
    assert (env / "files" / "setup.sh").read_text() == "echo mine\n"
    write_setup_scripts(SetupRequest(tmp_path / "tasks", force=True))
    assert "harbor_hpc_setup" in (env / "files" / "setup.sh").read_text()


def test_unreplayable_dockerfile_is_named_and_others_written(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    make_task(root, "multi", "FROM a AS b\nFROM c\nCOPY --from=b /x /x\n", {})
    make_task(root, "missing", "FROM a\nCOPY nothere.txt /x\n", {})
    make_task(root, "fine", "FROM a\nRUN true\n", {})
    result = write_setup_scripts(SetupRequest(root, replay_copy=True))
    assert result.written == ["fine"]
    messages = {problem.path.parent.parent.name: problem.message for problem in result.problems}
    assert messages["multi"] == "cannot replay: COPY --from=b"
    assert "nothere.txt is not in the build context" in messages["missing"]


def test_replay_expands_the_build_args_the_image_was_built_with(tmp_path: Path) -> None:
    root = tmp_path / "tasks"
    env = make_task(root, "t", "FROM a\nARG DATA\nCOPY $DATA /data\n", {"one.txt": "1"})
    without = write_setup_scripts(SetupRequest(root, replay_copy=True, dry_run=True))
    assert "$DATA has no value" in without.problems[0].message
    result = write_setup_scripts(SetupRequest(root, replay_copy=True, build_args=["DATA=one.txt"]))
    assert result.written == ["t"]
    assert "one.txt" in (env / "files" / "setup.sh").read_text()


def test_script_fails_clearly_without_python_deps_or_wheels(tmp_path: Path) -> None:
    env = make_task(tmp_path / "tasks", "t", "FROM base\n", {})
    write_setup_scripts(SetupRequest(tmp_path / "tasks"))
    no_pip = tmp_path / "python-without-anything"
    no_pip.write_text("#!/bin/sh\nexit 1\n")
    no_pip.chmod(0o755)
    run = run_script(env / "files" / "setup.sh", env / "files", no_pip)
    assert run.returncode == 1
    assert "has no pip" in run.stderr


def test_wheels_folder_must_hold_the_server_packages(tmp_path: Path) -> None:
    (tmp_path / "uvicorn-0.1-py3-none-any.whl").write_text("")
    with pytest.raises(InputError, match="no wheel for fastapi"):
        check_wheels(tmp_path)


@pytest.mark.docker
def test_script_installs_server_deps_offline_in_a_container(tmp_path: Path) -> None:
    wheels = Path(os.environ.get("HARBOR_HPC_TEST_WHEELS", "/nonexistent"))
    if not wheels.is_dir():
        pytest.skip("HARBOR_HPC_TEST_WHEELS is not set")
    image = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    env = make_task(tmp_path / "tasks", "t", "FROM base\nCOPY app.py /app/\n", {"app.py": "1\n"})
    result = write_setup_scripts(
        SetupRequest(tmp_path / "tasks", wheels_dir=wheels, replay_copy=True)
    )
    assert result.written == ["t"]
    files = env / "files"
    assert {wheel.name for wheel in (files / "wheels").iterdir()} >= {
        wheel.name for wheel in wheels.glob("*.whl")
    }
    check = (
        "bash /staging/env_files/setup.sh && bash /staging/env_files/setup.sh 2>second.log "
        "&& /opt/harbor-server/bin/python3 -c 'import uvicorn, fastapi' "
        "&& cat /app/app.py && test ! -s second.log"
    )
    run = subprocess.run(
        [
            *("docker", "run", "--rm", "--network=none", "-w", "/tmp"),
            *("-v", f"{files}:/staging/env_files:ro", image, "bash", "-c", check),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "1\n"
    assert "installed uvicorn and fastapi" in run.stderr


@pytest.mark.docker
def test_script_says_why_an_image_without_python_cannot_serve(tmp_path: Path) -> None:
    image = os.environ.get("HARBOR_HPC_TEST_NOPY_IMAGE", "local/debian-nopython:bookworm")
    env = make_task(tmp_path / "tasks", "t", "FROM base\n", {})
    write_setup_scripts(SetupRequest(tmp_path / "tasks"))
    run = subprocess.run(
        [
            *("docker", "run", "--rm", "--network=none"),
            *("-v", f"{env / 'files'}:/staging/env_files:ro", image),
            *("bash", "/staging/env_files/setup.sh"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "no python3 in this image" in run.stderr
