"""What a run is asked to be: `SubmitOptions`, as the CLI's flags and the Python API meet
harbor-hpc.toml (`configured_options`), and the environment kwargs it records."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from harbor_hpc.containers.environment_kwargs import ENVIRONMENT, accepted_environment_kwargs
from harbor_hpc.core.config import Config, chosen_cache_dir, configured
from harbor_hpc.core.errors import InputError
from harbor_hpc.core.imports import import_class
from harbor_hpc.slurm.cluster import Executor, SlurmPlacement

# The .sif store's kwarg, as our environment and Harbor's own Singularity environment take it.
CACHE_KWARG = "singularity_image_cache_dir"

# What Harbor's agents that can record each model call's token ids and logprobs (terminus-2)
# take to do so. RL runs train on those, so submit turns it on unless the user says false.
ROLLOUT_KWARG = "collect_rollout_details"


@dataclass
class SubmitOptions:
    agent: str
    model: str | None = None
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    # `--agent-env NAME` (the value from this environment) or `NAME=VALUE`.
    agent_env: list[str] = field(default_factory=list)
    environment: str = ENVIRONMENT
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    # `--cache-dir` and `--scratch-dir` as given: they reach the environment as kwargs.
    cache_dir: Path | None = None
    scratch_dir: Path | None = None
    executor: str = Executor.AUTO
    # Where the array jobs go; its time, when given, is every element's.
    placement: SlurmPlacement = field(default_factory=SlurmPlacement)
    array_parallelism: int | None = None
    tasks_per_job: int = 1
    concurrency: int = 1
    attempts: int = 1
    mem_mb: int | None = None
    cpus: int | None = None
    # Let the owner's group read the run folder (never write it); others never see it.
    group_readable: bool = False
    # Ask the agent's model server before anything is queued (model_server.py).
    model_check: bool = True
    # Refuse the whole run when a task's image is missing (the CLI reports such tasks and
    # runs the rest; a trainer's batch is refused before it starts).
    require_images: bool = False
    # The key of the verifier's rewards (reward.json) that is each trial's reward; None:
    # `reward`, else a lone value (docs/results.md, "Which reward").
    reward_key: str | None = None
    # Into an existing run: run again the tasks that changed since they were recorded (their
    # instruction, task.toml, tests, environment...), where it would refuse them.
    rerun_changed: bool = False
    # What harbor-hpc.toml may set; the .sif store is read from it when the environment is
    # placed (`placed_environment_kwargs`).
    CONFIGURED: ClassVar[tuple[str, ...]] = (
        "scratch_dir",
        "executor",
        "array_parallelism",
        "tasks_per_job",
        "concurrency",
        "reward_key",
    )

    def to_json(self) -> dict[str, Any]:
        """What run.json records of the options (its `options`), placement flattened in."""
        placement = self.placement.to_json()
        return {
            "executor": self.executor,
            "partition": placement["partition"],
            "account": placement["account"],
            "qos": placement["qos"],
            "array_parallelism": self.array_parallelism,
            "tasks_per_job": self.tasks_per_job,
            "concurrency": self.concurrency,
            "attempts": self.attempts,
            "time_min": placement["time_min"],
            "mem_mb": self.mem_mb,
            "cpus": self.cpus,
            "sbatch_args": placement["sbatch_args"],
            "setup": placement["setup"],
            "group_readable": self.group_readable,
            "reward_key": self.reward_key,
        }


def configured_options(
    config: Config | None,
    /,
    *,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    time_min: int | None = None,
    sbatch_args: list[str] | None = None,
    setup: list[str] | None = None,
    **given: Any,
) -> SubmitOptions:
    """The run's options from what the CLI's flags or the Python API gave (None: not given),
    else harbor-hpc.toml (`core.config.configured`), else the defaults. A run's elements also
    take the file's time_min, which sizes trials (a build's or conversion's never do)."""
    placement = configured(
        SlurmPlacement,
        config,
        keys=(*SlurmPlacement.CONFIGURED, "time_min"),
        partition=partition,
        account=account,
        qos=qos,
        time_min=time_min,
        sbatch_args=tuple(sbatch_args or ()),
        setup=setup,
    )
    return configured(SubmitOptions, config, placement=placement, **given)


def recorded_placement(options: dict[str, Any]) -> SlurmPlacement:
    """The placement a run recorded (`SubmitOptions.to_json`)."""
    return SlurmPlacement(
        options.get("partition"),
        options.get("account"),
        options.get("qos"),
        options.get("time_min"),
        tuple(options.get("sbatch_args") or ()),
        tuple(options.get("setup") or ()),
    )


def parse_key_values(pairs: list[str], what: str) -> dict[str, Any]:
    """`K=V` options into a dict; values that read as JSON (numbers, true, lists) are typed."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"{what} {pair!r} is not KEY=VALUE", hint=f"e.g. {what} timeout=30")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return parsed


def placed_environment_kwargs(options: SubmitOptions) -> dict[str, Any]:
    """`options`' environment kwargs with the .sif store and scratch folder chosen (`placed`)."""
    return placed(
        options.environment,
        options.environment_kwargs,
        cache_dir=options.cache_dir,
        scratch_dir=options.scratch_dir,
    )


def placed(
    environment: str,
    environment_kwargs: dict[str, Any],
    *,
    cache_dir: Path | None,
    scratch_dir: Path | None,
) -> dict[str, Any]:
    """The environment kwargs with the .sif store and the scratch folder the user chose.

    The store is the one `convert` and `doctor` use. When none is chosen the environment picks
    its default on the node that runs the trial; chosen by $HARBOR_HPC_CACHE or the config
    rather than by --cache-dir, it goes only to an environment that takes it. Kwargs given by
    name win.
    """
    kwargs = dict(environment_kwargs)
    store = chosen_cache_dir(cache_dir)
    if store is not None and (
        cache_dir is not None
        or CACHE_KWARG in accepted_environment_kwargs(import_class("--environment", environment))
    ):
        kwargs.setdefault(CACHE_KWARG, str(store.absolute()))
    if scratch_dir is not None:
        kwargs.setdefault("scratch_dir", str(scratch_dir.expanduser().absolute()))
    return kwargs
