import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harbor_hpc.containers.store import is_ready
from harbor_hpc.steps.convert import plan_conversions
from harbor_hpc.tasks.manifest import (
    ImageRecord,
    Manifest,
    RoleImage,
    TaskRecord,
    load_manifest,
    save_manifest,
)
from tests.support.fake_slurm import FakeSlurm
from tests.support.images import Recorder, TinyImage, damage, write_manifest

DIGEST = "sha256:" + "ab" * 32
MISSING = "sha256:" + "00" * 32


@pytest.fixture(autouse=True)
def no_user_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's harbor-hpc.toml must not change what these tests see."""
    empty = tmp_path / "empty-config.toml"
    empty.write_text("")
    monkeypatch.setenv("HARBOR_HPC_CONFIG", str(empty))
    monkeypatch.delenv("HARBOR_HPC_CACHE", raising=False)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "convert", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "250", **(env or {})},  # no wrapping inside messages
        timeout=600,
        check=False,
    )


def record(repository: str, digest: str | None, tasks: list[str], **extra: str) -> ImageRecord:
    return ImageRecord(repository=repository, tag="ctx", tasks=tasks, digest=digest, **extra)


def test_plan_names_unusable_images_and_merges_identical_ones(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    write_manifest(
        manifest,
        {
            "one": record("localhost:5000/ns/a", DIGEST, ["t/1"]),
            "two": record("localhost:5000/ns/a", DIGEST, ["t/2"]),  # same image, other context
            "broken": record("localhost:5000/ns/b", None, ["t/3"], error="RUN step failed"),
            "unpushed": record("localhost:5000/ns/c", None, ["t/4"]),
        },
    )
    planned = plan_conversions(manifest, tmp_path / "store")
    states = {c.image: (c.state, c.tasks) for c in planned}
    assert states[f"localhost:5000/ns/a@{DIGEST}"] == ("to convert", ["t/1", "t/2"])
    assert states["localhost:5000/ns/b:ctx"][0] == "failed"
    assert states["localhost:5000/ns/c:ctx"][0] == "failed"
    assert not (tmp_path / "store").exists()


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, {"one": record("localhost:5000/ns/a", DIGEST, ["t/1"])})
    before = manifest.read_text()
    result = cli("--manifest", str(manifest), "--cache-dir", str(tmp_path / "store"), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "would convert localhost:5000/ns/a@" in result.stdout
    assert manifest.read_text() == before
    assert not (tmp_path / "store").exists()


def test_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    result = cli("--manifest", str(tmp_path / "nope.json"))
    assert result.returncode == 2
    assert "nope.json: no such manifest" in result.stderr
    assert "Traceback" not in result.stderr
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, {})
    result = cli("--manifest", str(manifest), "--slurm", "--source", "docker-daemon")
    assert result.returncode == 2
    assert "compute nodes" in result.stderr


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_convert_records_sifs_reports_failures_and_reruns_from_cache(
    tiny_image: TinyImage, tiny_sif: Path, tmp_path: Path, recorder: Recorder
) -> None:
    repository, digest = tiny_image.open_ref.split("@")
    manifest = tmp_path / "manifest.json"
    good = record(repository, digest, ["dom/good-1", "dom/good-2"])
    write_manifest(
        manifest,
        {"good": good, "gone": record(repository.replace("tiny", "gone"), MISSING, ["dom/lost"])},
    )
    store = str(tiny_sif.parent)

    result = cli("--manifest", str(manifest), "--cache-dir", store, "--nohttps", "--json")
    assert result.returncode == 1
    summary = json.loads(result.stdout)
    assert (summary["cached"], summary["failed"]) == (1, 1)
    failed = next(image for image in summary["images"] if image["state"] == "failed")
    assert failed["tasks"] == ["dom/lost"]
    # The registry's words as Apptainer passes them on, or ours where a node has no Apptainer.
    assert "manifest unknown" in failed["error"] or "has no harbor-hpc-test/gone" in failed["error"]
    assert load_manifest(manifest).images["good"].sif == str(tiny_sif)

    human = cli("--manifest", str(manifest), "--cache-dir", store, "--nohttps")
    assert "gone@" in human.stderr and "dom/lost" in human.stderr

    # A fully cached rerun: no Apptainer call at all (bench/convert_cached.py times it).
    write_manifest(manifest, {"good": good})
    recording = {"HARBOR_HPC_APPTAINER": str(recorder.binary)}
    rerun = cli("--manifest", str(manifest), "--cache-dir", store, env=recording)
    assert rerun.returncode == 0, rerun.stderr
    assert "1 cached" in rerun.stdout
    assert recorder.calls() == []
    assert load_manifest(manifest).images["good"].sif == str(tiny_sif)


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_verify_finds_a_damaged_sif_and_converts_it_again(
    tiny_image: TinyImage, tmp_path: Path
) -> None:
    repository, digest = tiny_image.open_ref.split("@")
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, {"good": record(repository, digest, ["dom/good"])})
    store = tmp_path / "store"
    args = ["--manifest", str(manifest), "--cache-dir", str(store), "--nohttps"]
    first = cli(*args, "--json")
    assert json.loads(first.stdout)["converted"] == 1, first.stderr
    sif = Path(load_manifest(manifest).images["good"].sif or "")

    damage(sif)
    assert json.loads(cli(*args, "--json").stdout)["cached"] == 1  # a `stat` sees nothing
    checked = cli(*args, "--verify")
    assert checked.returncode == 0, checked.stderr
    assert f"damaged: {sif} did not match the sha256 recorded" in checked.stderr
    assert "1 converted, 1 damaged" in checked.stdout

    again = json.loads(cli(*args, "--verify", "--json").stdout)
    assert (again["cached"], again["damaged"], again["verified"]) == (1, 0, True)


@pytest.mark.apptainer
@pytest.mark.registry  # the shared test image is pushed to both registries
@pytest.mark.docker
def test_convert_from_docker_daemon(tiny_image: TinyImage, tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    name, tag = tiny_image.tag.split(":")
    write_manifest(manifest, {"local": ImageRecord(repository=name, tag=tag, tasks=["t/1"])})
    result = cli(
        "--manifest",
        str(manifest),
        "--cache-dir",
        str(tmp_path / "store"),
        "--source",
        "docker-daemon",
    )
    assert result.returncode == 0, result.stderr
    sif = load_manifest(manifest).images["local"].sif
    assert sif is not None and is_ready(Path(sif))


@pytest.mark.slurm
@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_convert_on_slurm(tiny_image: TinyImage, tmp_path: Path) -> None:
    """Each element runs the site's setup lines first (a `module`-like function one line
    defines, called by the next), then converts its image into the store."""
    repository, digest = tiny_image.open_ref.split("@")
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, {"img": record(repository, digest, ["t/1"])})
    store = tmp_path / "store"
    mark = tmp_path / "setup-ran"
    partition = os.environ.get("HARBOR_HPC_TEST_SLURM_PARTITION", "debug")
    result = cli(
        "--manifest", str(manifest), "--cache-dir", str(store), "--nohttps", "--slurm",
        "--partition", partition, "--time", "10", "--json",
        "--setup", f'site_module() {{ echo "loaded $* in $SLURM_JOB_ID" >> {mark}; }}',
        "--setup", "site_module apptainer",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    summary = json.loads(result.stdout)
    assert summary["converted"] == 1
    sif = load_manifest(manifest).images["img"].sif
    assert sif is not None and is_ready(Path(sif))
    assert list((store / ".slurm").iterdir())  # the array job's logs
    assert re.fullmatch(r"loaded apptainer in \d+\n", mark.read_text())


def test_slurm_refusal_is_a_clear_error(tmp_path: Path, fake_slurm: FakeSlurm) -> None:
    fake_slurm.answer(
        "sbatch", stderr="sbatch: error: invalid partition specified: no-such\n", returncode=1
    )
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, {"img": record("localhost:5000/ns/a", DIGEST, ["t/1"])})
    store = str(tmp_path / "store")
    result = cli(
        "--manifest", str(manifest), "--cache-dir", store, "--slurm", "--partition", "no-such",
        "--mem", "2048",
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "error: Slurm refused the conversion job: sbatch: error: invalid partition specified: "
        "no-such" in result.stderr
    )
    assert "Traceback" not in result.stderr
    [[script]] = fake_slurm.calls("sbatch")
    assert "#SBATCH --partition=no-such" in Path(script).read_text()
    assert "#SBATCH --mem=2048M\n" in Path(script).read_text()


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
@pytest.mark.apptainer_only
def test_a_terminated_convert_leaves_no_tool_running_and_no_partial_file(
    tiny_image: TinyImage, tmp_path: Path, recorder: Recorder
) -> None:
    repository, digest = tiny_image.open_ref.split("@")
    manifest = tmp_path / "manifest.json"
    write_manifest(manifest, {"tiny": record(repository, digest, ["dom/task"])})
    store = tmp_path / "store"
    # The pull writes its temporary file, then the `apptainer` stand-in sleeps: killed there.
    argv = [sys.executable, "-m", "harbor_hpc", "convert", "--manifest", str(manifest)]
    converter = subprocess.Popen(
        [*argv, "--cache-dir", str(store), "--nohttps"],
        env={**os.environ, "HARBOR_HPC_APPTAINER": str(recorder.binary), "PULL_DELAY_AFTER": "60"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own session: what it leaves running is findable
    )
    try:
        deadline = time.monotonic() + 60
        while not list(store.glob(".*.partial")):
            assert time.monotonic() < deadline and converter.poll() is None, converter.stderr
            time.sleep(0.1)
        converter.terminate()
        _, err = converter.communicate(timeout=30)
    finally:
        left = [p for p in psutil.process_iter(["pid"]) if _session(p) == converter.pid]
        for process in left:
            process.kill()
        if converter.poll() is None:
            converter.kill()
    assert converter.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "terminated" in err
    assert left == []
    # Nothing that looks finished, nothing half-written (a lock file may stay: it is free).
    assert [p.name for p in store.iterdir() if p.suffix in (".sif", ".partial")] == []


def _session(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


@pytest.mark.apptainer
@pytest.mark.registry
@pytest.mark.docker
def test_a_compose_services_image_reference_is_converted_and_recorded_for_its_task(
    tiny_image: TinyImage, tiny_sif: Path, tmp_path: Path
) -> None:
    manifest = tmp_path / "manifest.json"
    recorded = Manifest("localhost:5000/ns", str(tmp_path))
    recorded.tasks["pod"] = TaskRecord(None, services={"db": RoleImage(None, tiny_image.open_ref)})
    save_manifest(manifest, recorded)
    result = cli(
        "--manifest", str(manifest), "--cache-dir", str(tiny_sif.parent), "--nohttps", "--json"
    )
    assert result.returncode == 0, result.stderr
    (image,) = json.loads(result.stdout)["images"]
    assert image["tasks"] == ["pod"]
    assert load_manifest(manifest).tasks["pod"].services["db"].sif == str(tiny_sif)
