"""The test runs' own hygiene: a run that was killed leaves its folder (images, .sifs), which
the next run of the same user removes."""

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests import conftest


def test_the_folder_of_a_killed_run_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen(["true"])
    ended.wait()
    folders = {}
    for name, pid in (("killed", ended.pid), ("running", os.getpid())):
        folder = folders[name] = tmp_path / f"harbor-hpc-test-run-{name}"
        folder.mkdir()
        (folder / "pid").write_text(f"{pid}\n")
    unknown = tmp_path / "harbor-hpc-test-run-old"  # no pid: left alone
    unknown.mkdir()
    conftest._remove_killed_runs()
    assert not folders["killed"].exists()
    assert folders["running"].exists() and unknown.exists()
