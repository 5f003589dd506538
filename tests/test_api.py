"""The Python API: one surface, and the same harbor-hpc.toml the CLI reads."""

from __future__ import annotations

from pathlib import Path

import pytest

import harbor_hpc.api
from harbor_hpc.api import load_config
from harbor_hpc.steps.submit import configured_options


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
    options = configured_options(load_config(), agent="oracle", qos="high", concurrency=None)
    assert options.placement.partition == "cpu"
    assert options.concurrency == 4
    assert options.scratch_dir == Path("/local/scratch")
    assert options.placement.qos == "high"
    assert options.executor == "auto" and options.tasks_per_job == 1  # nothing said: defaults


def test_a_step_request_takes_the_config_as_the_cli_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`configured` is the one merge of harbor-hpc.toml with what a caller gave, for the CLI's
    flags and the Python API alike."""
    (tmp_path / "harbor-hpc.toml").write_text(
        'manifest = "~/m.json"\njobs = 5\ncache_dir = "/from/config"\npartition = "cpu"\n'
        'build_args = ["A=1", "B=2"]\ntime_min = 30\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    monkeypatch.setenv("HARBOR_HPC_CACHE", "/from/env")
    convert = harbor_hpc.api.configured(harbor_hpc.api.ConvertRequest, jobs=None)
    assert convert.manifest == Path("~/m.json").expanduser() and convert.jobs == 5
    assert convert.cache_dir == Path("/from/env")  # $HARBOR_HPC_CACHE before the file
    build = harbor_hpc.api.configured(
        harbor_hpc.api.BuildRequest, tasks_dir=tmp_path, build_args=["B=3"], jobs=1
    )
    assert build.build_args == ["A=1", "B=2", "B=3"] and build.jobs == 1  # given wins
    placement = harbor_hpc.api.configured(harbor_hpc.api.SlurmPlacement, qos="high")
    # A build's or conversion's time is never the file's time_min, which sizes trials.
    assert (placement.partition, placement.qos, placement.time_min) == ("cpu", "high", None)
    assert configured_options(None, agent="oracle").placement.time_min == 30


def test_a_required_field_neither_given_nor_configured_names_its_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    with pytest.raises(harbor_hpc.api.InputError, match="no manifest given") as raised:
        harbor_hpc.api.configured(harbor_hpc.api.ConvertRequest)
    assert raised.value.hint == "pass --manifest, or set manifest in harbor-hpc.toml"
