"""The Python API: one surface, and the same harbor-hpc.toml the CLI reads."""

from __future__ import annotations

from pathlib import Path

import pytest

import harbor_hpc.api
from harbor_hpc.api import load_config
from harbor_hpc.slurm.submit import configured_options


def test_every_name_of_the_surface_is_there() -> None:
    missing = [name for name in harbor_hpc.api.__all__ if not hasattr(harbor_hpc.api, name)]
    assert missing == []
    # The environments are the very classes Harbor loads by import path.
    from harbor_hpc.environment import RaySingularityEnvironment, SingularityEnvironment

    assert harbor_hpc.api.SingularityEnvironment is SingularityEnvironment
    assert harbor_hpc.api.RaySingularityEnvironment is RaySingularityEnvironment


def test_options_not_given_come_from_the_config_and_given_ones_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "harbor-hpc.toml").write_text(
        'partition = "cpu"\nconcurrency = 4\nscratch_dir = "/local/scratch"\nqos = "low"\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    options = configured_options(load_config(), "oracle", qos="high", concurrency=None)
    assert options.partition == "cpu"
    assert options.concurrency == 4
    assert options.scratch_dir == Path("/local/scratch")
    assert options.qos == "high"
    assert options.executor == "auto" and options.tasks_per_job == 1  # nothing said: defaults
