"""The kwargs of `SingularityEnvironment` as Harbor's typed options (`options_model`): one
list, which `harbor environment schema` prints, Harbor's parsing checks, and our own checks
read (`environment_kwargs.accepted_environment_kwargs`). Apart from environment_kwargs.py, which
the command line imports at start: this one loads Harbor and pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from harbor.environments.options import EnvironmentOptions
from pydantic import BeforeValidator, Field


def _not_a_flag(value: object) -> object:
    """A size is no yes/no: `unpacked_roots=true` would otherwise be 1 GiB."""
    if isinstance(value, bool):
        raise ValueError("a number of GiB, not true or false")
    return value


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
    runtime: Literal["auto", "apptainer", "enroot"] | None = Field(
        None,
        description="What starts the containers: `apptainer`, `enroot` (NVIDIA's, where a node "
        "has no Apptainer), or `auto`, Apptainer where there is one, else enroot (the default; "
        "$HARBOR_HPC_RUNTIME, else the config file's `runtime`, sets it for every run).",
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
    snapshot_storage_mb: int | None = Field(
        None,
        gt=0,
        description="The most disk the snapshots this process takes (`fork`, `snapshot`) may "
        "hold at once, in MB (default: no cap but the disk's).",
    )
    restore_from: Path | None = Field(
        None,
        description="A snapshot this process took (`SingularityEnvironment.snapshot`, its "
        "`path`): the container starts from its files (what `fork` and `restore` set).",
    )
    unpacked_roots: Annotated[
        Annotated[float, Field(ge=0, allow_inf_nan=False)] | Literal["auto"],
        BeforeValidator(_not_a_flag),
    ] = Field(
        "auto",
        description="Images unpacked in the scratch folder, the lower folder of containers' own "
        "roots (faster than the .sif through squashfuse): `auto` (the default) unpacks an image "
        "that starts again on the node, in the background (its starts meanwhile from the .sif), "
        "up to a quarter of the disk's free space, never on a tmpfs; N keeps up to N GiB, each "
        "image unpacked at its first start; 0 never.",
    )
