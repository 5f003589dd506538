"""Rollouts from Python, for trainers: run a folder of tasks N times, get the records back.

    from harbor_hpc.api import RolloutRequest, run_rollouts

    lines = run_rollouts(RolloutRequest(
        tasks=Path("tasks"), run_dir=Path("runs/step-0042"), agent="terminus-2",
        model="openai/policy", agent_kwargs={"api_base": "http://10.0.0.5:8000/v1"},
        attempts=8, concurrency=4,
    ))
    for line in lines:                    # one per attempt, schema harbor-hpc/rollout/v2
        line["token_ids"], line["mask_ids"], line["reward"], line["trainable"]

It is `submit --wait` then `export` in one call, through the very same code: the trials run in
harbor-hpc's Apptainer environment (`harbor_hpc.environment:SingularityEnvironment`), by default
as local processes of this machine (a trainer's own allocation), or as Slurm array jobs with
`executor="slurm"`; the run folder is a run like any other (`status`, `resubmit`, `export` work
on it), and the lines are those `export --format` writes, the attempts that count only. Secrets
go by name (`agent_env`), their values read from this process's environment by the jobs,
never written down. A training loop calls it from a thread (`asyncio.to_thread`) to keep
serving while trials run.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harbor_hpc.results.export import ExportFormat, rollout_lines
from harbor_hpc.steps.runs import follow
from harbor_hpc.steps.submit import configured_options, submit_run


@dataclass
class RolloutRequest:
    """What to run: every task under `tasks`, `attempts` times each, into `run_dir` (new, or
    the same run again to add nothing but what is missing). Fields left None take the value
    harbor-hpc.toml gives the option of that name, as the CLI's flags do, else its default."""

    tasks: Path
    run_dir: Path
    agent: str
    model: str | None = None
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    # Names of variables the agent gets from this process's environment (API keys).
    agent_env: list[str] = field(default_factory=list)
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    attempts: int = 1
    # Local processes of this machine (a trainer's own allocation), or "slurm" for array jobs.
    executor: str = "local"
    # None: from harbor-hpc.toml (cache_dir also from $HARBOR_HPC_CACHE), else the default.
    cache_dir: Path | None = None
    scratch_dir: Path | None = None
    concurrency: int | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int | None = None
    format: ExportFormat = ExportFormat.FULL


def run_rollouts(request: RolloutRequest) -> list[dict[str, Any]]:
    """Run the request's trials to the end and return the rollout lines of the attempts that
    count (in `request.format`). Raises `HarborHpcError` for bad input, as the CLI reports it."""
    options = configured_options(
        None,  # harbor-hpc.toml here, as the CLI reads it
        agent=request.agent,
        model=request.model,
        agent_kwargs=dict(request.agent_kwargs),
        agent_env=list(request.agent_env),
        environment_kwargs=dict(request.environment_kwargs),
        cache_dir=request.cache_dir,
        scratch_dir=request.scratch_dir,
        executor=request.executor,
        partition=request.partition,
        account=request.account,
        qos=request.qos,
        time_min=request.time_min,
        attempts=request.attempts,
        concurrency=request.concurrency,
    )
    # One process (or element) runs `concurrency` trials at once.
    submit_run(request.tasks, request.run_dir, replace(options, tasks_per_job=options.concurrency))
    *_, final = follow(request.run_dir)
    lines, _ = rollout_lines(request.run_dir, final.attempts, fmt=request.format)
    return [line for line in lines if line.get("counts", True)]
