"""The Apptainer probes on the real Apptainer, and against an install that does not start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_hpc.apptainer import probes
from harbor_hpc.apptainer.environment import SingularityEnvironment
from harbor_hpc.apptainer.runtime import find_apptainer
from harbor_hpc.core.probe import Finding, Status


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
