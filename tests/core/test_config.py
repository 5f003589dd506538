from pathlib import Path

import pytest

from harbor_hpc.core.config import Config, cache_dir, load_config
from harbor_hpc.core.errors import InputError


def test_config_from_working_folder_and_flags_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "harbor-hpc.toml").write_text('partition = "gpu"\njobs = 4\n')
    config = load_config()
    assert config.source == tmp_path / "harbor-hpc.toml"
    assert config.pick("partition", None, "debug") == "gpu"
    assert config.pick("partition", "cpu", "debug") == "cpu"
    assert config.pick("qos", None, "normal") == "normal"


def test_user_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    user = tmp_path / "xdg" / "harbor-hpc" / "config.toml"
    user.parent.mkdir(parents=True)
    user.write_text('cache_dir = "/scratch/sif"\n')
    assert load_config().pick("cache_dir", None, "") == "/scratch/sif"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("partion = 'x'", "unknown key 'partion'"),
        ("jobs = 'four'", "jobs must be an integer"),
        ("jobs = true", "jobs must be an integer"),
        ("jobs = ", "not valid TOML"),
        ("build_args = 'A=1'", "build_args must be a list"),
        ("build_args = ['A=1', 2]", "build_args must be a list of strings"),
    ],
)
def test_bad_config_names_file_and_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    path = tmp_path / "conf.toml"
    path.write_text(text)
    monkeypatch.setenv("HARBOR_HPC_CONFIG", str(path))
    with pytest.raises(InputError, match=message) as info:
        load_config()
    assert str(path) in info.value.message


def test_cache_dir_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HARBOR_HPC_CACHE", raising=False)
    assert cache_dir(None, Config()) == tmp_path / ".cache" / "harbor-hpc" / "sif"
    configured = Config({"cache_dir": "~/sifs"})
    assert cache_dir(None, configured) == tmp_path / "sifs"
    monkeypatch.setenv("HARBOR_HPC_CACHE", "/scratch/sif")
    assert cache_dir(None, configured) == Path("/scratch/sif")
    assert cache_dir(Path("~/flag"), configured) == tmp_path / "flag"
