"""The Apptainer probes on the real Apptainer, and against an install that does not start."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_hpc.containers import probes
from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.probe import Finding, Status
from harbor_hpc.runtimes.apptainer import find_apptainer, run_flags, sif_compression, zstd_here

# Apptainer's install and what doctor finds of it (enroot's: tests/containers/test_enroot.py).
pytestmark = pytest.mark.apptainer_only


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {finding.name: finding for finding in findings}


@pytest.fixture
def broken_apptainer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An `apptainer` that cannot start, as with a library missing on a login node."""
    broken = tmp_path / "apptainer"
    broken.write_text(
        "#!/bin/sh\necho 'error while loading shared libraries: libc.so.6' >&2\nexit 127\n"
    )
    broken.chmod(0o755)
    monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(broken))
    find_apptainer.cache_clear()
    yield broken
    find_apptainer.cache_clear()


def test_a_broken_install_stops_the_preflight_with_its_error(broken_apptainer: Path) -> None:
    found = by_name(probes.findings(broken_apptainer.parent / "cache"))
    assert found["binary"].status is Status.OK
    assert found["version"].status is Status.MISSING and "libc.so.6" in found["version"].detail
    assert "run an image" not in found  # nothing more is tried with a binary that cannot start
    with pytest.raises(SystemExit, match=r"libc\.so\.6.*reinstall"):
        SingularityEnvironment.preflight()


def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, says: str, fails: str = "") -> Path:
    """An install whose `--version` says `says` (as each project words it) and whose every
    other command fails saying `fails`."""
    binary = tmp_path / "apptainer"
    binary.write_text(
        f"#!/bin/sh\n[ \"$1\" = --version ] && echo '{says}' && exit 0\necho '{fails}' >&2\n"
        "exit 255\n"
    )
    binary.chmod(0o755)
    monkeypatch.setenv("HARBOR_HPC_APPTAINER", str(binary))
    find_apptainer.cache_clear()
    sif_compression.cache_clear()
    zstd_here.cache_clear()
    return binary


@pytest.fixture(autouse=True)
def _forget_the_install() -> Iterator[None]:
    yield
    find_apptainer.cache_clear()
    sif_compression.cache_clear()
    zstd_here.cache_clear()


@pytest.mark.parametrize(
    "says",
    ["singularity-ce version 4.1.0", "singularity version 3.8.7", "apptainer version 1.0.3"],
)
def test_an_install_harbor_hpc_cannot_use_is_named_at_start(
    says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed(tmp_path, monkeypatch, says)
    version = by_name(probes.install_findings())["version"]
    assert version.status is Status.MISSING and "Apptainer 1.1.0 or newer" in version.detail
    assert says.split(" version ")[0] in version.detail
    with pytest.raises(SystemExit, match=r"Apptainer 1\.1\.0 or newer"):
        SingularityEnvironment.preflight()


def test_apptainer_before_1_4_converts_with_gzip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--mksquashfs-args (and zstd images) came in Apptainer 1.4.0: an older one gets neither."""
    installed(tmp_path, monkeypatch, "apptainer version 1.3.6")
    version = by_name(probes.install_findings())["version"]
    assert version.status is Status.WARN and "converted with gzip" in version.detail
    assert sif_compression().options == ()


def test_a_zstd_image_on_a_node_before_1_4_says_how_to_convert_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = "FATAL: while loading: corrupted image: unknown compression algorithm value 6"
    installed(tmp_path, monkeypatch, "apptainer version 1.3.6", fails=said)
    sif = tmp_path / "image.sif"
    sif.write_bytes(b"")
    with pytest.raises(HarborHpcError) as raised:
        run_flags(sif)
    assert said in raised.value.message
    assert raised.value.hint is not None and 'sif_compression = "gzip"' in raised.value.hint


def test_sif_compression_gzip_is_a_site_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "harbor-hpc.toml").write_text('sif_compression = "gzip"\n')
    monkeypatch.setenv("HARBOR_HPC_CONFIG", str(tmp_path / "harbor-hpc.toml"))
    sif_compression.cache_clear()
    zstd_here.cache_clear()
    assert sif_compression().options == ()
    (tmp_path / "harbor-hpc.toml").write_text('sif_compression = "lz4"\n')
    sif_compression.cache_clear()
    zstd_here.cache_clear()
    with pytest.raises(InputError, match="must be one of auto, zstd, gzip, not 'lz4'"):
        sif_compression()
    # doctor names it rather than leaving the line out.
    [finding] = probes.compression_findings()
    assert finding.status is Status.WARN and "not 'lz4'" in finding.detail


@pytest.mark.apptainer
def test_the_probe_image_is_built_into_the_cache_and_runs_as_tasks_do(tmp_path: Path) -> None:
    found = by_name(probes.findings(tmp_path))
    for name in ("binary", "version", "task container", "run an image"):
        assert found[name].status is Status.OK, found[name]
    assert list((tmp_path / ".doctor").glob("probe-*.sif"))
    again = by_name(probes.findings(tmp_path))
    assert again["run an image"].status is Status.OK


@pytest.mark.apptainer
def test_a_cache_that_cannot_keep_the_image_still_proves_exec(tmp_path: Path) -> None:
    # A regular file where the cache should be: nothing can be kept, a temporary image is used.
    blocker = tmp_path / "file"
    blocker.write_text("")
    found = by_name(probes.findings(blocker))
    assert found["run an image"].status is Status.OK, found["run an image"].detail
    assert found["task container"].status is Status.OK, found["task container"].detail


FLEET = """
from harbor_hpc.containers.probes import fleet_finding
found = fleet_finding()
print(found.status.value, found.detail, sep="\\n")
"""


def test_the_fleet_line_names_the_limit_that_runs_out_first() -> None:
    """With `ulimit -u 2000` (a cluster's per-user cap), some 25 processes and threads to an
    environment fit 80 of them: doctor warns, naming that limit."""
    script = f"ulimit -Su 2000 && ulimit -Hu 2000 && exec {sys.executable} -c '{FLEET}'"
    said = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    status, detail = said.stdout.splitlines()
    assert status == Status.WARN.value, detail
    assert detail.startswith("room for about 80 environments at once for you here, beside")
    assert "(ulimit -u 2000) runs out first" in detail


def test_a_start_that_runs_out_of_a_node_limit_names_it() -> None:
    """Apptainer's words when `ulimit -u` runs out (recorded from apptainer 1.4.5 run with a
    ulimit -u just above the user's tasks) name the limit, and how many fit."""
    said = "runtime/cgo: pthread_create failed: Resource temporarily unavailable\nSIGABRT: abort"
    named = probes.ran_out(said)
    assert named is not None and "ran out of processes and threads (ulimit -u)" in named
    assert probes.ran_out("FATAL: could not open image: no such file") is None
