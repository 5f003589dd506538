"""Which environment kwargs a Harbor environment class takes (`--environment-kwarg NAME=...`):
the one definition `submit` checks before queueing and our environment checks when created."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from harbor.environments.options import EnvironmentOptions
from pydantic import Field

# The environment `submit` runs trials in unless told otherwise, by the import path Harbor takes.
ENVIRONMENT = "harbor_hpc.environment:SingularityEnvironment"

HARBOR_PASSES = frozenset(
    {
        "environment_dir",
        "environment_name",
        "session_id",
        "trial_paths",
        "task_env_config",
        "logger",
        "mounts",
        "network_policy",
        "phase_network_policies",
        "enable_environment_dir_upload",
        "stream",
    }
)


class SingularityOptions(EnvironmentOptions):  # type: ignore[misc]  # harbor ships no types
    """The kwargs of `SingularityEnvironment` (`--environment-kwarg k=v`), as Harbor's typed
    options: `harbor environment schema harbor_hpc.environment:SingularityEnvironment` lists
    them, and Harbor refuses a misspelt one before any trial."""

    singularity_image_cache_dir: Path | None = Field(
        None,
        description="Where registry references are converted to .sif (the store `harbor-hpc "
        "convert` fills; default $HARBOR_HPC_CACHE, else ~/.cache/harbor-hpc/sif).",
    )
    singularity_force_pull: bool = Field(
        False, description="Convert again even when the .sif is cached."
    )
    singularity_no_mount: str | None = Field(
        None,
        description='Comma-separated Apptainer mounts to leave out (default "home,tmp,'
        'bind-paths"; "" keeps them all).',
    )
    workdir: str | None = Field(
        None,
        description="The container's working directory (default: the task's workdir, else "
        "the image's WORKDIR, else /).",
    )
    fakeroot: bool = Field(
        True,
        description="Root inside the container, as in Docker; off runs the task as the "
        "submitting user, without root.",
    )
    nohttps: bool | None = Field(
        None, description="Reach the registry over plain HTTP when converting."
    )
    memory_watchdog: bool = Field(
        True, description="Kill the container above the task's memory_mb."
    )
    memory_kill_fraction: float = Field(
        0.95, gt=0, le=1, description="The share of memory_mb at which the watchdog kills."
    )
    memory_poll_interval_sec: float = Field(
        0.05, gt=0, description="How often the watchdog looks whether the tree may have grown."
    )
    scratch_dir: Path | None = Field(
        None,
        description="Where the private per-trial folder goes (staging and the writable "
        "overlay; default $TMPDIR, which Slurm sites point at node-local scratch).",
    )
    extra_hosts: str | None = Field(
        None,
        description="`name:address,...` lines for the container's /etc/hosts, as "
        "`docker run --add-host` (a network allowlist resolves these names so too).",
    )
    unpacked_roots: float = Field(
        0,
        ge=0,
        description="GiB of images to keep unpacked in the scratch folder, from which task "
        "containers start some four times as fast (fakeroot containers only).",
    )


def option_names(cls: type) -> set[str]:
    """The user-facing fields of `cls.options_model` (none where it declares no model)."""
    model = getattr(cls, "options_model", None)
    if model is None:
        return set()
    return {name for name, spec in model.model_fields.items() if not spec.exclude}


def accepted_environment_kwargs(cls: type) -> list[str]:
    """The kwargs users may pass `cls`: the fields of its `options_model` (Harbor's typed
    options) and the named parameters of `__init__` along its MRO, up to and including
    Harbor's BaseEnvironment, less those Harbor passes itself."""
    from harbor.environments.base import BaseEnvironment

    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names: set[str] = option_names(cls)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and klass is not object:
            parameters = inspect.signature(init).parameters.values()
            names |= {p.name for p in parameters if p.kind in named and p.name != "self"}
        if klass is BaseEnvironment:
            break
    return sorted(names - HARBOR_PASSES)


def flag(value: Any) -> bool:
    """A boolean kwarg as `--environment-kwarg k=v` may deliver it (JSON or a plain string)."""
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)
