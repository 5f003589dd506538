"""How a run's attempts become array jobs: grouped by what their trials ask for, chunked into
elements, each element sized for its own tasks and fit to the partition's nodes. Plans only:
`launch` records and queues them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from harbor_hpc.core.errors import InputError
from harbor_hpc.results.record import RunRecord, Unit
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, NodeLimits
from harbor_hpc.slurm.resources import (
    Resources,
    TrialRequest,
    chunked,
    element_resources,
    fit_to_node,
    trial_budget_sec,
    trial_request,
)
from harbor_hpc.steps.submit.options import recorded_placement
from harbor_hpc.tasks.discovery import Task


@dataclass
class Group:
    """Tasks whose trials ask for the same resources, chunked on their own into the elements
    of one array job (more past MaxArraySize), each element sized for these tasks alone."""

    resources: Resources
    chunks: list[list[Unit]]
    # Slurm tells each element this long before its time limit to stop and requeue.
    requeue_warning_s: int | None = None
    # Trials too long for an element's --time: they would be cut off at every requeue.
    too_long: dict[str, int] = field(default_factory=dict)
    # What an element's trials (their memory_mb, so many at once) and harbor-hpc's own processes
    # need, where its --mem (the user's, or the biggest node's) is less; else None.
    memory_needed_mb: int | None = None

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(unit.task for chunk in self.chunks for unit in chunk))

    def to_json(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "trials": sum(len(chunk) for chunk in self.chunks),
            "elements": len(self.chunks),
            "resources": self.resources.to_json(),
            "requeue_warning_s": self.requeue_warning_s,
            "too_long": self.too_long,
            "memory_needed_mb": self.memory_needed_mb,
        }


def plan_chunks(
    units: list[Unit], *, tasks_per_job: int, local_processes: int | None = None
) -> list[list[Unit]]:
    """Group units by task, `tasks_per_job` tasks an element (all attempts of a task together).

    Local runs have no scheduler to hold elements back, so they are cut into at most
    `local_processes` (default 1) elements that all run at once.
    """
    by_task: dict[str, list[Unit]] = {}
    for unit in units:
        by_task.setdefault(unit.task, []).append(unit)
    groups = list(by_task.values())
    size = tasks_per_job
    if local_processes is not None and groups:
        size = max(size, math.ceil(len(groups) / max(1, local_processes)))
    return [[unit for group in chunk for unit in group] for chunk in chunked(groups, size)]


def plan_groups(
    record: RunRecord, units: list[Unit], tasks: dict[str, Task], executor: Executor
) -> list[Group]:
    """`units` in groups of tasks whose trials ask for the same cpus, memory, gpus and time,
    each group chunked and sized on its own, so that one big task never sizes the elements of
    small ones.

    What the user gave (--cpus, --mem, --time) every element asks for, so it splits no tasks.
    A local run is one group: local processes take only a time limit, and `local_processes`
    bounds the whole run.
    """
    options = record.options
    local = executor is Executor.LOCAL
    by_request: dict[TrialRequest | None, list[Unit]] = {}
    for unit in units:
        key = None if local else _grouping_key(options, tasks[unit.task])
        by_request.setdefault(key, []).append(unit)
    # Derived requests must fit a node; local processes ask no scheduler.
    limits = (
        None
        if local or not units
        else cluster.partition_limits(recorded_placement(options).partition)
    )
    groups = []
    for members in by_request.values():
        chunks = plan_chunks(
            members,
            tasks_per_job=int(options["tasks_per_job"]),
            # Local elements all start at once, so without --array-parallelism there is one
            # process, as --help promises, not one process per task.
            local_processes=(options.get("array_parallelism") or 1) if local else None,
        )
        group_tasks = [tasks[rel] for rel in dict.fromkeys(unit.task for unit in members)]
        trials = max(len(chunk) for chunk in chunks)
        # What the trials need; the user's options may give the element less (below).
        element = element_resources(
            group_tasks, trials=trials, concurrency=int(options["concurrency"])
        )
        group = Group(_resources(options, element, group_tasks, limits), chunks)
        if not local:
            group.requeue_warning_s = cluster.requeue_warning_s(group.resources.time_min)
            working_s = group.resources.time_min * 60 - group.requeue_warning_s
            budgets = {task.rel: trial_budget_sec(task) for task in group_tasks}
            group.too_long = {
                rel: math.ceil(budget)
                for rel, budget in sorted(budgets.items())
                if budget > working_s
            }
            if group.resources.mem_mb < element.mem_mb:
                group.memory_needed_mb = element.mem_mb
        groups.append(group)
    return groups


# Trial times are grouped on a ladder (up to 15 min, 30, 60, 120...), not to the second: a
# dataset whose tasks each set their own timeout would otherwise be one small array per task.
TIME_STEP_S = 15 * 60


def _time_bucket(seconds: float) -> float:
    bucket = TIME_STEP_S
    while bucket < seconds:
        bucket *= 2
    return bucket


def _grouping_key(options: dict[str, Any], task: Task) -> TrialRequest:
    """What sets `task`'s elements apart: its trials' request, less what the user gave."""
    request = trial_request(task)
    return TrialRequest(
        cpus=0 if options.get("cpus") else request.cpus,
        mem_mb=0 if options.get("mem_mb") else request.mem_mb,
        gpus=request.gpus,
        seconds=0 if options.get("time_min") else _time_bucket(request.seconds),
        gpu_types=request.gpu_types,
    )


def _resources(
    options: dict[str, Any], element: Resources, tasks: list[Task], limits: NodeLimits | None
) -> Resources:
    """What the user gave, passed on as is; the rest from what `tasks`' trials need (`element`)
    cut to fit the partition's biggest node (`limits`)."""
    if "gres" in recorded_placement(options).sbatch():
        element = replace(element, gpu_types=())  # the user's GRES names the GPUs
    try:
        derived = fit_to_node(element, limits)
    except InputError as exc:
        names = ", ".join(task.rel for task in tasks[:3]) + (" ..." if len(tasks) > 3 else "")
        raise InputError(f"{names}: {exc.message}", hint=exc.hint) from None
    return Resources(
        options.get("time_min") or derived.time_min,
        options.get("mem_mb") or derived.mem_mb,
        options.get("cpus") or derived.cpus,
        derived.gpus,
        derived.gpu_types,
        0 if options.get("mem_mb") else derived.worker_mb,
    )
