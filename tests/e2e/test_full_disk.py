"""A full disk, on the real kernel (a small filesystem of the tester's own, filled to the last
byte): each command says so in one line naming the path, leaves nothing half-written, and once
there is space again the same command finishes the work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from harbor_hpc.tasks.manifest import ImageRecord
from tests.fetch.test_cli import run_fetch
from tests.support.fakehub import FakeHub
from tests.support.hub_data import REPO_ID
from tests.support.images import TinyImage, write_manifest
from tests.support.small_disk import fill, small_disk, unfill
from tests.tasks.test_rewrite import make_task
from tests.tasks.test_rewrite import write_manifest as write_rewrite_manifest

FULL = "No space left on device"
DIGEST = "sha256:" + "d" * 64
pytestmark = pytest.mark.small_disk


def harbor_hpc(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "empty-config.toml"
    config.write_text("")
    env = {**os.environ, "COLUMNS": "300", "HARBOR_HPC_CONFIG": str(config)}
    env.pop("HARBOR_HPC_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for text in expected:
        assert text in errors[0], result.stderr
    return errors[0]


def debris(folder: Path) -> list[str]:
    """Temporary files, and anything in a store's scratch folder (`.tmp`, kept empty)."""
    return sorted(
        str(p.relative_to(folder))
        for p in folder.rglob("*")
        if (p.name.endswith((".tmp", ".partial")) and p.name != ".tmp") or p.parent.name == ".tmp"
    )


def test_fetch_into_a_full_disk(fake_hub: FakeHub, tmp_path: Path) -> None:
    args = (REPO_ID, "--include", "skill_based/mixed/", "--json")
    with small_disk(tmp_path, megabytes=16) as disk:
        dest = disk / "tasks"
        fill(disk)
        refused = run_fetch(*args, "--dest", str(dest), endpoint=fake_hub.url, hf_home=tmp_path)
        one_line_error(refused, FULL)
        assert debris(disk) == []

        unfill(disk)
        fetched = run_fetch(*args, "--dest", str(dest), endpoint=fake_hub.url, hf_home=tmp_path)
        assert fetched.returncode == 0, fetched.stderr
        assert json.loads(fetched.stdout)["tasks_by_folder"] == {"skill_based": 3}


def test_rewrite_and_export_on_a_full_disk(tmp_path: Path) -> None:
    with small_disk(tmp_path, megabytes=16) as disk:
        root = disk / "tasks"
        tomls = [make_task(root, name, "[environment]\ncpus = 1\n") for name in ("a", "b")]
        manifest = tmp_path / "manifest.json"
        record = ImageRecord("localhost:5000/ns/a", "a" * 64, ["a", "b"], DIGEST)
        write_rewrite_manifest(manifest, root, record)
        fill(disk)

        refused = harbor_hpc("rewrite", str(root), "--manifest", str(manifest), tmp_path=tmp_path)
        assert refused.returncode == 1, refused.stderr
        assert "Traceback" not in refused.stderr
        for toml in tomls:
            assert f"{toml}: not written: {FULL}" in refused.stderr
            assert toml.read_text() == "[environment]\ncpus = 1\n"
        assert debris(disk) == []

        out = disk / "rollouts.jsonl"
        run = tmp_path / "run"  # a run with nothing finished: export writes an empty file
        from harbor_hpc.results.record import RunRecord, create_run

        create_run(run, RunRecord(str(root), [], "oracle", None, {}, "x:Y", {}, {}))
        exported = harbor_hpc("export", str(run), "--out", str(out), tmp_path=tmp_path)
        one_line_error(exported, str(out), FULL)
        assert not out.exists() and debris(disk) == []

        unfill(disk)
        again = harbor_hpc("rewrite", str(root), "--manifest", str(manifest), tmp_path=tmp_path)
        assert again.returncode == 0, again.stderr
        for toml in tomls:
            image = tomllib.loads(toml.read_text())["environment"]["docker_image"]
            assert image == f"localhost:5000/ns/a@{DIGEST}"
        exported = harbor_hpc("export", str(run), "--out", str(out), tmp_path=tmp_path)
        assert exported.returncode == 0 and out.exists(), exported.stderr


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_convert_into_a_full_store(tiny_image: TinyImage, tmp_path: Path) -> None:
    repository, digest = tiny_image.open_ref.split("@")
    manifest = tmp_path / "manifest.json"
    image = ImageRecord(repository=repository, tag="ctx", tasks=["dom/t"], digest=digest)
    write_manifest(manifest, {"ctx": image})
    with small_disk(tmp_path, megabytes=64) as disk:
        store = disk / "sif"
        args = ("convert", "--manifest", str(manifest), "--cache-dir", str(store), "--nohttps")
        store.mkdir()
        fill(disk, leave=256 << 10)  # room to start; the pull itself runs out of space
        refused = harbor_hpc(*args, tmp_path=tmp_path)
        assert refused.returncode == 1, refused.stderr
        assert "Traceback" not in refused.stderr
        assert f"failed: {tiny_image.open_ref}" in refused.stderr
        assert "no space left on device" in refused.stderr.lower(), refused.stderr
        # Apptainer's conversion, or ours from the layers where a node has no Apptainer.
        assert (
            "hint: the store's filesystem (or APPTAINER_TMPDIR's) is full" in refused.stderr
            or "hint: free space on that filesystem or write elsewhere" in refused.stderr
        ), refused.stderr
        assert not list(store.glob("*.sif")) and debris(disk) == []

        unfill(disk)
        converted = harbor_hpc(*args, "--json", tmp_path=tmp_path)
        assert converted.returncode == 0, converted.stderr
        assert json.loads(converted.stdout)["converted"] == 1
        assert debris(disk) == []


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.apptainer_only  # its small disk (FUSE) refuses the kernel's overlay: Apptainer's own
def test_a_trial_whose_scratch_disk_fills_up_is_never_a_trainable_zero(
    debian_sif: Path, tmp_path: Path
) -> None:
    """Another user fills the node's scratch disk while the agent works: its answer cannot be
    written, the verifier gives 0, and that zero is the node's (infrastructure, for
    `resubmit`), never one a trainer learns from."""
    from tests.support.sample_tasks import make_task as make_sample_task

    make_sample_task(tmp_path / "tasks", "answer", kind="marks_then_pauses", image=str(debian_sif))
    run_dir = tmp_path / "run"
    with small_disk(tmp_path, megabytes=64) as disk:
        waiting = subprocess.Popen(
            [sys.executable, "-m", "harbor_hpc", "submit", str(tmp_path / "tasks"), "--agent",
             "oracle", "--run-dir", str(run_dir), "--executor", "local", "--scratch-dir",
             str(disk), "--wait"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            while not list(disk.glob("**/tmp/started")) and time.monotonic() < deadline:
                assert waiting.poll() is None, waiting.communicate()
                time.sleep(0.2)
            fill(disk)  # before it writes its answer
            _, err = waiting.communicate(timeout=300)
        finally:
            waiting.kill()
    assert waiting.returncode == 1, err
    (status,) = json.loads(harbor_hpc("status", str(run_dir), "--json", tmp_path=tmp_path).stdout)
    assert (status["state"], status["failure"], status["trainable"]) == (
        "failed", "infrastructure", False,
    ), status  # fmt: skip
    assert status["message"].startswith("its scratch disk was full"), status
    assert status["reward"] in (None, 0.0)  # the verifier gave 0, or could not even start
