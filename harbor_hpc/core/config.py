"""Defaults users would otherwise type every time, from `harbor-hpc.toml`.

Looked up in this order, first found wins: `$HARBOR_HPC_CONFIG`, `./harbor-hpc.toml`,
`$XDG_CONFIG_HOME/harbor-hpc/config.toml` (`~/.config/...`). The file is a flat table whose keys
are option names with underscores (`cache_dir = "/scratch/sif"`). A flag given on the command line
always wins over the file.

`configured` is the one place the file meets what a caller gave: the CLI's flags and the Python
API's arguments go through it alike, into a step's request.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from harbor_hpc.core.errors import InputError

# Every key a config file may set, with the type its value must have.
CACHE_ENV = "HARBOR_HPC_CACHE"

KNOWN_KEYS: dict[str, type] = {
    "registry": str,
    "manifest": str,
    "cache_dir": str,
    "wheels_dir": str,
    "jobs": int,
    "partition": str,
    "account": str,
    "qos": str,
    "time_min": int,
    "run_dir": str,
    "scratch_dir": str,
    "executor": str,
    "array_parallelism": int,
    "tasks_per_job": int,
    "concurrency": int,
    # The key of the verifier's reward.json that is a trial's reward (`--reward-key`).
    "reward_key": str,
    "nohttps": bool,
    # `build_args = ["NAME=VALUE"]`: `--build-arg` values every build gets (flags win per NAME).
    "build_args": list,
    # How .sif images are compressed: "zstd" (where the converting node can) or "gzip", which
    # every Apptainer reads (for nodes whose Apptainer is older than 1.4).
    "sif_compression": str,
    # What starts the containers: "apptainer", "enroot" or "auto" (`runtime` of the environment).
    "runtime": str,
    # `setup = ["module load apptainer"]`: shell lines every Slurm job of ours runs first.
    "setup": list,
}
# The keys whose values are paths (`~` expanded).
PATH_KEYS = frozenset({"manifest", "cache_dir", "wheels_dir", "run_dir", "scratch_dir"})

T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    values: dict[str, Any] = field(default_factory=dict)
    source: Path | None = None

    def pick(self, key: str, flag: T | None, default: T) -> T:
        """The flag when given, else the config file's value, else `default`."""
        if flag is not None:
            return flag
        value: T = self.values.get(key, default)
        return value


def config_candidates() -> list[Path]:
    explicit = os.environ.get("HARBOR_HPC_CONFIG")
    if explicit:
        return [Path(explicit)]
    xdg = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [Path.cwd() / "harbor-hpc.toml", xdg / "harbor-hpc" / "config.toml"]


def load_config() -> Config:
    for path in config_candidates():
        if path.is_file():
            return Config(_parse(path), path)
    if os.environ.get("HARBOR_HPC_CONFIG"):
        raise InputError(
            f"{os.environ['HARBOR_HPC_CONFIG']}: config file not found",
            hint="fix or unset HARBOR_HPC_CONFIG",
        )
    return Config()


def _parse(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid TOML ({exc})") from None
    for key, value in data.items():
        expected = KNOWN_KEYS.get(key)
        if expected is None:
            raise InputError(
                f"{path}: unknown key {key!r}",
                hint="known keys: " + ", ".join(sorted(KNOWN_KEYS)),
            )
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            kind = {str: "a string", int: "an integer", bool: "true or false", list: "a list"}
            raise InputError(f"{path}: {key} must be {kind[expected]}, not {value!r}")
        if isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise InputError(f"{path}: {key} must be a list of strings, not {value!r}")
    return data


class Request(Protocol):
    """A step's request: a dataclass naming the fields harbor-hpc.toml may set."""

    CONFIGURED: ClassVar[tuple[str, ...]]


def configured[R: Request](
    cls: type[R], config: Config | None = None, /, *, keys: tuple[str, ...] = (), **given: Any
) -> R:
    """`cls(**given)` (a step's request dataclass) with harbor-hpc.toml filling in: each field
    named in `cls.CONFIGURED` (or `keys`) that was not given, or given as None, takes the file's
    value (`cache_dir`: $HARBOR_HPC_CACHE first); a list value (`build_args`) comes before the
    given one, which wins per name. What neither gives keeps the field's default; a required
    field that neither gives is an `InputError` naming its option.

    One merge for the CLI (its flags are `given`, None when not typed) and the Python API (its
    arguments), so that both read the file the same way. `config` defaults to `load_config()`.
    """
    config = load_config() if config is None else config
    values = {key: value for key, value in given.items() if value is not None}
    for key in keys or cls.CONFIGURED:
        if key == "cache_dir":
            chosen = values.get(key) or chosen_cache_dir(None, config)
            if chosen is not None:
                values[key] = chosen
            continue
        if key not in config.values:
            continue
        value = config.values[key]
        if isinstance(value, list):
            values[key] = [*value, *values.get(key, [])]
        elif key not in values:
            values[key] = Path(value).expanduser() if key in PATH_KEYS else value
    assert is_dataclass(cls)
    for spec in fields(cls):
        unset = spec.default is MISSING and spec.default_factory is MISSING
        if unset and spec.init and spec.name not in values:
            option = spec.name.replace("_", "-")
            raise InputError(
                f"no {option} given",
                hint=f"pass --{option}, or set {spec.name} in harbor-hpc.toml",
            )
    return cls(**values)


def chosen_cache_dir(flag: Path | None = None, config: Config | None = None) -> Path | None:
    """The .sif store the user chose: `--cache-dir`, else `$HARBOR_HPC_CACHE`, else the config
    file's `cache_dir` (read here when `config` is not given), else None."""
    if flag is not None:
        return flag.expanduser()
    if config is None:
        config = load_config()
    chosen = os.environ.get(CACHE_ENV) or config.values.get("cache_dir")
    return Path(chosen).expanduser() if chosen else None


def default_cache_dir() -> Path:
    """The .sif store when the user chose none."""
    return Path.home() / ".cache" / "harbor-hpc" / "sif"


def cache_dir(flag: Path | None = None, config: Config | None = None) -> Path:
    """Where .sif files live: the store the user chose, else `~/.cache/harbor-hpc/sif`."""
    return chosen_cache_dir(flag, config) or default_cache_dir()
