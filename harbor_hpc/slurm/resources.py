"""How work is cut into array elements and what each element asks Slurm for.

An element runs K tasks (all their attempts), C trials at a time. Unless the user says otherwise
it asks for what its tasks declare in task.toml: C times the largest memory_mb, cpus and gpus,
and enough time for its tasks to run in waves of C, each wave as long as the slowest task's
agent and verifier timeouts plus the time a container takes to come up, with headroom on top.
Submit puts tasks that ask alike (`TrialRequest`) in elements of their own, so one big task
sizes only its own elements. Requests larger than the partition's biggest node would never
start, so they are cut to that node.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from harbor_hpc.core.errors import InputError
from harbor_hpc.slurm.cluster import NodeLimits
from harbor_hpc.tasks.discovery import Task

# Harbor's defaults when task.toml leaves them out (the verifier's, TaskConfig applies).
DEFAULT_AGENT_TIMEOUT_SEC = 600.0
DEFAULT_MEMORY_MB = 2048
# Starting a container, copying files in and out, stopping it: per trial, on a busy node.
ENVIRONMENT_OVERHEAD_SEC = 120.0
# The worker's own Python (Harbor, asyncio, submitit) on top of the containers.
WORKER_MEMORY_MB = 1024
TIME_HEADROOM = 1.25
TIME_HEADROOM_MIN = 5


@dataclass(frozen=True)
class Resources:
    time_min: int
    mem_mb: int
    cpus: int
    gpus: int = 0
    # The GPU types the tasks accept (task.toml's spelling until fit to a partition's, which
    # keeps the one Slurm will be asked for).
    gpu_types: tuple[str, ...] = ()
    # Of mem_mb, what the element's own processes (Harbor, the worker) get beside its trials'
    # memory_mb; 0 when the user sized the element (--mem).
    worker_mb: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_json(cls, data: dict[str, Any]) -> Resources:
        return cls(**{**data, "gpu_types": tuple(data.get("gpu_types", ()))})


@dataclass(frozen=True)
class TrialRequest:
    """What one trial of a task asks for, its task.toml's values or Harbor's defaults."""

    cpus: int
    mem_mb: int
    gpus: int
    # The longest the trial may take (`trial_budget_sec`).
    seconds: float
    gpu_types: tuple[str, ...] = ()


def trial_request(task: Task) -> TrialRequest:
    gpus: int | None = task.config.environment.gpus
    types: list[str] | None = task.config.environment.gpu_types if gpus else None
    return TrialRequest(
        task.cpus or 1,
        task.memory_mb or DEFAULT_MEMORY_MB,
        gpus or 0,
        trial_budget_sec(task),
        tuple(types or ()),
    )


def chunked[T](items: list[T], size: int) -> list[list[T]]:
    """`items` in consecutive groups of `size` (the last may be shorter)."""
    if size < 1:
        raise ValueError("chunk size must be at least 1")
    return [items[i : i + size] for i in range(0, len(items), size)]


def trial_budget_sec(task: Task) -> float:
    """The longest one trial of `task` may take: its timeouts plus the environment's overhead."""
    agent = task.agent_timeout_sec or DEFAULT_AGENT_TIMEOUT_SEC
    return agent + task.verifier_timeout_sec + ENVIRONMENT_OVERHEAD_SEC


def element_resources(tasks: list[Task], *, trials: int, concurrency: int) -> Resources:
    """What one element running `trials` trials of `tasks`, `concurrency` at a time, needs."""
    parallel = max(1, min(concurrency, trials))
    waves = math.ceil(trials / parallel)
    requests = [trial_request(task) for task in tasks]
    slowest = max(request.seconds for request in requests)
    time_min = math.ceil(waves * slowest * TIME_HEADROOM / 60) + TIME_HEADROOM_MIN
    memory = max(request.mem_mb for request in requests)
    cpus = max(request.cpus for request in requests)
    most = max(requests, key=lambda request: request.gpus)
    return Resources(
        time_min,
        parallel * memory + WORKER_MEMORY_MB,
        parallel * cpus,
        parallel * most.gpus,
        most.gpu_types,
        WORKER_MEMORY_MB,
    )


def fit_to_node(resources: Resources, limits: NodeLimits | None) -> Resources:
    """`resources` cut to the partition's biggest node, and the first GPU type the tasks accept
    that its nodes offer, as Slurm names it (task.toml says `H100`, Slurm `h100`, say).

    Raises InputError when the partition offers none of the types the tasks accept."""
    if limits is None:
        return resources
    gpu_types = resources.gpu_types
    if resources.gpus and gpu_types:
        offered = {name.lower(): name for name in limits.gpu_types}
        chosen = [offered[name.lower()] for name in gpu_types if name.lower() in offered]
        if not chosen:
            raise InputError(
                f"the tasks ask for GPUs of type {' or '.join(gpu_types)}; the partition's nodes "
                f"offer {', '.join(sorted(limits.gpu_types)) or 'no typed GPUs'}",
                hint="submit them to a partition with those GPUs (--partition), or name the "
                "GRES yourself (--sbatch-arg gres=gpu:TYPE:N)",
            )
        gpu_types = (chosen[0],)
    return replace(
        resources,
        mem_mb=min(resources.mem_mb, limits.mem_mb),
        cpus=min(resources.cpus, limits.cpus),
        gpu_types=gpu_types,
    )
