"""Submit a run (`submit`) or what is left of one (`resubmit`) as submitit array jobs.

The plan is made first and written to `run.json` before anything is queued, so a run whose
submission is interrupted still says what it was meant to be; the job ids are added as soon
as Slurm hands them out. Tasks whose image is missing are recorded and not submitted. Tasks
that ask for different resources go out as arrays of their own, each element sized for its
tasks (`plan_groups`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import math
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harbor_hpc.apptainer.environment_kwargs import ENVIRONMENT, accepted_environment_kwargs, flag
from harbor_hpc.apptainer.store import sif_file, unavailable
from harbor_hpc.core.config import Config, cache_dir, chosen_cache_dir
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.files import LockTimeout, file_lock
from harbor_hpc.core.imports import cannot_import, import_class
from harbor_hpc.results.classify import AttemptState, FailureClass
from harbor_hpc.results.record import (
    Chunk,
    RunPaths,
    RunRecord,
    Submission,
    Unit,
    create_run,
    load_run,
    make_private,
    now_iso,
    update_run,
)
from harbor_hpc.results.status import AttemptStatus, attempt_statuses
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, JobRequest, NodeLimits, choose_executor
from harbor_hpc.slurm.resources import (
    Resources,
    TrialRequest,
    chunked,
    element_resources,
    fit_to_node,
    trial_budget_sec,
    trial_request,
)
from harbor_hpc.slurm.runs import live_jobs
from harbor_hpc.slurm.worker import ChunkWorker, use_local_cost_map
from harbor_hpc.tasks.discovery import Task, discover_tasks, load_task

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
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    array_parallelism: int | None = None
    tasks_per_job: int = 1
    concurrency: int = 1
    attempts: int = 1
    time_min: int | None = None
    mem_mb: int | None = None
    cpus: int | None = None
    sbatch_args: list[str] = field(default_factory=list)
    # Let the owner's group read the run folder (never write it); others never see it.
    group_readable: bool = False

    def to_json(self) -> dict[str, Any]:
        keys = (
            "executor",
            "partition",
            "account",
            "qos",
            "array_parallelism",
            "tasks_per_job",
            "concurrency",
            "attempts",
            "time_min",
            "mem_mb",
            "cpus",
            "sbatch_args",
            "group_readable",
        )
        return {key: getattr(self, key) for key in keys}


# The options a harbor-hpc.toml may set for a run, by the config key that names the field.
CONFIGURED = (
    "scratch_dir",
    "executor",
    "partition",
    "account",
    "qos",
    "array_parallelism",
    "tasks_per_job",
    "concurrency",
    "time_min",
)


def configured_options(config: Config, agent: str, **given: Any) -> SubmitOptions:
    """The run's options as the CLI's flags and the Python API meet harbor-hpc.toml: what was
    given (None: not given), else the config file's value, else the default."""
    values = {key: value for key, value in given.items() if value is not None}
    for key in CONFIGURED:
        if key not in values and key in config.values:
            value = config.values[key]
            values[key] = Path(value) if key == "scratch_dir" else value
    return SubmitOptions(agent=agent, **values)


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
        }


@dataclass
class SubmitResult:
    run_dir: Path
    executor: Executor
    submission: int | None
    job_ids: list[str]
    units: list[Unit]
    groups: list[Group]
    image_problems: dict[str, str]
    skipped: list[AttemptStatus] = field(default_factory=list)
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    # As recorded: with token collection (`collect_rollout_details`) on by default.
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    # Only planned: nothing was queued or recorded.
    dry_run: bool = False

    @property
    def chunks(self) -> list[list[Unit]]:
        return [chunk for group in self.groups for chunk in group.chunks]

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "executor": self.executor,
            "submission": self.submission,
            "job_ids": self.job_ids,
            "trials": len(self.units),
            "elements": len(self.chunks),
            "groups": [group.to_json() for group in self.groups],
            "image_problems": self.image_problems,
            "agent_kwargs": self.agent_kwargs,
            "environment_kwargs": self.environment_kwargs,
            "dry_run": self.dry_run,
        }


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


def parse_sbatch_args(args: list[str]) -> dict[str, Any]:
    """Extra sbatch options (`--constraint=a100`, `gres=gpu:1`, `--exclusive`) for submitit."""
    extra: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.lstrip("-").partition("=")
        if not key:
            raise InputError(
                f"--sbatch-arg {arg!r} is empty", hint="e.g. --sbatch-arg constraint=a100"
            )
        extra[key.replace("-", "_")] = value if sep else True
    return extra


ReferenceCheck = Callable[[str], str | None]


def reference_check(environment_kwargs: dict[str, Any]) -> ReferenceCheck:
    """Why no node could get a registry reference (None when one can), asked once per image:
    from the .sif store the run's environment uses, else from the registry."""
    store = environment_kwargs.get(CACHE_KWARG)
    nohttps = environment_kwargs.get("nohttps")
    return functools.cache(
        lambda image: unavailable(
            image,
            Path(store) if store else cache_dir(None, Config()),
            nohttps=None if nohttps is None else flag(nohttps),
        )
    )


def image_problem(task: Task, check: ReferenceCheck) -> str | None:
    """Why `task` cannot run for want of an image (its own, or its separate verifier's), or None
    when its images are there to use: a .sif that exists, or a reference a node can get."""
    image = task.docker_image
    if not image:
        return (
            f"{task.task_toml}: no environment.docker_image (run `harbor-hpc build`, then "
            "`harbor-hpc rewrite --sif`; after a Docker build, `harbor-hpc convert` before it)"
        )
    problem = _image_problem(image, task.environment_dir, check)
    if problem is not None:
        return f"{task.task_toml}: docker_image {problem}"
    return _verifier_image_problem(task, check)


def _image_problem(image: str, folder: Path, check: ReferenceCheck) -> str | None:
    sif = sif_file(image, folder)
    if sif is not None:
        return (
            None
            if sif.is_file()
            else f"{image} does not exist (build or convert into that store, or run "
            "`harbor-hpc rewrite --sif` with the manifest that has its .sif)"
        )
    why = check(image)
    if why is None:
        return None
    return f"{image} cannot be had: {why} (build and push it, or fix the reference)"


def _verifier_image_problem(task: Task, check: ReferenceCheck) -> str | None:
    """Harbor's separate verifier takes `[verifier.environment] docker_image`, else builds
    tests/Dockerfile (or tests/docker-compose.yaml), else runs in the task's own image."""
    if not task.separate_verifier:
        return None
    image = task.verifier_docker_image
    if not image:
        built = [
            name
            for name in ("Dockerfile", "docker-compose.yaml")
            if (task.tests_dir / name).is_file()
        ]
        if not built:
            return None  # the verifier runs in the task's own image
        return (
            f"{task.task_toml}: the separate verifier builds tests/{built[0]} but sets no "
            "verifier.environment.docker_image (run `harbor-hpc build`, then `harbor-hpc "
            "rewrite --sif`)"
        )
    # Harbor gives the verifier tests/ as its folder.
    problem = _image_problem(image, task.tests_dir, check)
    if problem is not None:
        return f"{task.task_toml}: verifier.environment.docker_image {problem}"
    return None


def agent_class(agent: str) -> type:
    """The class Harbor runs for `--agent`: a name its agent factory knows, or module:Class."""
    use_local_cost_map()  # agents that call models import litellm
    if ":" in agent:
        return import_class("--agent", agent)
    from harbor.agents.factory import AgentFactory
    from harbor.models.agent.name import AgentName

    names = AgentFactory.registered_names()
    if agent not in names:
        raise InputError(
            f"--agent {agent!r} is not a Harbor agent",
            hint="one of: " + ", ".join(names) + ", or an import path module:Class",
        )
    try:
        found: type = AgentFactory.get_agent_class(AgentName(agent))
    except Exception as exc:  # an import runs arbitrary code: any error is the agent's
        raise cannot_import("--agent", agent, exc) from None
    return found


def check_agent(
    agent: type, name: str, model: str | None, kwargs: dict[str, Any], task: Task
) -> None:
    """Refuse what would fail on every node: the agent made as a trial of `task` makes it,
    with `model` and `kwargs` (Harbor checks its options and the models it requires there)."""
    from harbor.models.trial.paths import TrialPaths

    with tempfile.TemporaryDirectory(prefix="harbor-hpc-agent-") as logs:
        extra: dict[str, Any] = {}
        if name == "oracle":  # what Harbor's trial gives the oracle (Trial._init_agent)
            extra = {"task_dir": task.path, "trial_paths": TrialPaths(Path(logs))}
        try:
            agent(logs_dir=Path(logs), model_name=model, **extra, **kwargs)
        except Exception as exc:  # the agent's own check, whatever it raises
            said = str(exc).strip() or type(exc).__name__
            given = sorted(key for key in kwargs if key != ROLLOUT_KWARG)
            first, _, rest = said.partition("\n")
            raise InputError(
                f"--agent {name} cannot be made with "
                + (f"--model {model}" if model else "no --model")
                + (f" and --agent-kwarg {', '.join(given)}" if given else "")
                + f" (for task {task.rel}): {first}",
                hint=" ".join(rest.split())
                or f"`harbor agent schema {name}` lists its options; check --model and the task",
            ) from None


def takes_kwarg(cls: type, name: str) -> bool:
    """Whether `cls(...)` takes `name`: a parameter of an `__init__` up its class chain (as far
    as each passes `**kwargs` on), or a field of its Harbor agent options model."""
    options = getattr(cls, "options_model", None)
    if options is not None and name in options.model_fields:
        return True
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters
        if name in parameters:
            return True
        if all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return False
    return False


def default_agent_kwargs(agent: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with token collection on for an agent that can collect tokens, unless the user
    set it (`--agent-kwarg collect_rollout_details=false`)."""
    if ROLLOUT_KWARG in kwargs or not takes_kwarg(agent, ROLLOUT_KWARG):
        return kwargs
    return {**kwargs, ROLLOUT_KWARG: True}


# What Harbor passes every environment itself, so a user's kwarg of that name is an error or
# silently lost: the trial's own arguments (harbor/trial/trial.py, both environments), and of the
# factory's (harbor/environments/factory.py) `stream`, which import-path environments refuse. The
# factory's others (override_cpus..., the enforcement policies, persistent_env,
# extra_docker_compose) come from TrialConfig.environment, which user kwargs override: allowed.
def check_environment(environment: str, kwargs: dict[str, Any]) -> None:
    """Refuse an environment that does not import, or kwargs it does not take."""
    accepted = accepted_environment_kwargs(import_class("--environment", environment))
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise InputError(
            f"--environment-kwarg {', '.join(unknown)}: not accepted by {environment}, which "
            f"takes: {', '.join(accepted) or 'none'}"
        )


def placed_environment_kwargs(options: SubmitOptions) -> dict[str, Any]:
    """The environment kwargs with the .sif store and the scratch folder the user chose.

    The store is the one `convert` and `doctor` use. When none is chosen the environment picks
    its default on the node that runs the trial; chosen by $HARBOR_HPC_CACHE or the config
    rather than by --cache-dir, it goes only to an environment that takes it. Kwargs given by
    name win.
    """
    kwargs = dict(options.environment_kwargs)
    store = chosen_cache_dir(options.cache_dir)
    if store is not None and (
        options.cache_dir is not None
        or CACHE_KWARG
        in accepted_environment_kwargs(import_class("--environment", options.environment))
    ):
        kwargs.setdefault(CACHE_KWARG, str(store.absolute()))
    if options.scratch_dir is not None:
        kwargs.setdefault("scratch_dir", str(options.scratch_dir.expanduser().absolute()))
    return kwargs


def refuse_secrets(kwargs: dict[str, Any], option: str) -> None:
    """A kwarg named like a secret (Harbor's own rule: key, secret, token, password...) would be
    written into run.json and every trial's config.json, readable for as long as they last."""
    from harbor.utils.env import is_sensitive_env_key

    secret = sorted(name for name in kwargs if is_sensitive_env_key(name))
    if secret:
        raise InputError(
            f"{option} {', '.join(secret)}: looks like a secret, and kwargs are written down",
            hint="pass it as --agent-env NAME (taken from your environment) or "
            "--agent-env NAME=VALUE: the agent gets it from the job's environment only",
        )


def pass_agent_env(specs: list[str]) -> list[str]:
    """The names of `--agent-env NAME[=VALUE]`; each value is put in this process's environment,
    which sbatch hands to the jobs (and local jobs inherit): it never reaches a file here."""
    names = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise InputError(
                f"--agent-env {name!r} is not a variable name", hint="e.g. OPENAI_API_KEY"
            )
        if sep:
            os.environ[name] = value
        names.append(name)
    require_agent_env(names)
    return sorted(set(names))


def require_agent_env(names: list[str]) -> None:
    """Refuse to queue a run whose agent would miss variables the caller did not set."""
    unset = [name for name in names if name not in os.environ]
    if unset:
        raise InputError(
            f"--agent-env {', '.join(unset)}: not set in your environment",
            hint="export it first, or pass --agent-env NAME=VALUE",
        )


def submit_run(
    tasks_dir: Path, run_dir: Path, options: SubmitOptions, *, dry_run: bool = False
) -> SubmitResult:
    """Discover the tasks, record the run in `run_dir`, and queue every task attempt."""
    if options.tasks_per_job < 1 or options.concurrency < 1 or options.attempts < 1:
        raise InputError("--tasks-per-job, --concurrency and --attempts must be at least 1")
    agent = agent_class(options.agent)
    agent_kwargs = default_agent_kwargs(agent, options.agent_kwargs)
    refuse_secrets(options.agent_kwargs, "--agent-kwarg")
    refuse_secrets(options.environment_kwargs, "--environment-kwarg")
    environment_kwargs = placed_environment_kwargs(options)
    check_environment(options.environment, environment_kwargs)
    executor = choose_executor(options.executor)
    run_dir = run_dir.expanduser().absolute()
    discovery = discover_tasks(tasks_dir, require_dockerfile=False)
    if discovery.problems:
        raise InputError(
            "some tasks cannot be read:\n  " + "\n  ".join(str(p) for p in discovery.problems),
            hint="fix or remove these task folders",
        )
    if not discovery.tasks:
        raise InputError(f"{tasks_dir}: no tasks (folders with task.toml) found")
    check_agent(agent, options.agent, options.model, agent_kwargs, discovery.tasks[0])
    record = RunRecord(
        tasks_root=str(discovery.root),
        tasks=[task.rel for task in discovery.tasks],
        agent=options.agent,
        model=options.model,
        agent_kwargs=agent_kwargs,
        agent_env=pass_agent_env(options.agent_env),
        environment=options.environment,
        environment_kwargs=environment_kwargs,
        options={**options.to_json(), "executor": str(executor)},
    )
    if not RunPaths(run_dir).record.exists() and not dry_run:
        make_private(run_dir, record.group_readable)
    with contextlib.nullcontext() if dry_run else only_writer(run_dir):
        if RunPaths(run_dir).record.exists():
            # The same submit again continues the run: it queues only what has no finished
            # trial.
            differences = load_run(run_dir).differences(record)
            if differences:
                raise InputError(
                    f"{run_dir}: already holds a run with another {', '.join(differences)}",
                    hint="pick another --run-dir, or `harbor-hpc resubmit` to continue that run",
                )
            return _resubmit(run_dir, failed=False, dry_run=dry_run)
        if not dry_run:
            create_run(run_dir, record)
        return _launch(run_dir, record, record.units(), discovery.by_rel(), dry_run=dry_run)


def resubmit_run(run_dir: Path, *, failed: bool = False, dry_run: bool = False) -> SubmitResult:
    """Queue again the attempts without a finished trial (and with `failed`, the failed ones).

    Attempts still pending or running are left alone; done ones are never run again.
    """
    run_dir = run_dir.expanduser().absolute()
    if dry_run:
        return _resubmit(run_dir, failed=failed, dry_run=True)
    load_run(run_dir)  # a folder without a run is named as such, before any lock file is made
    with only_writer(run_dir):
        return _resubmit(run_dir, failed=failed, dry_run=False)


@contextlib.contextmanager
def only_writer(run_dir: Path) -> Iterator[None]:
    """Be the one submit or resubmit of `run_dir`, from planning to the last queued job: two at
    once would each queue what the other queues."""
    try:
        with file_lock(RunPaths(run_dir).submit_lock, timeout=0):
            yield
    except LockTimeout as busy:
        raise HarborHpcError(
            f"{run_dir}: another submit or resubmit of this run is under way "
            f"({busy.message.rpartition('locked by ')[2]})",
            hint="wait for it to end, then run `harbor-hpc status` (or resubmit) on the run",
        ) from None


def _resubmit(run_dir: Path, *, failed: bool, dry_run: bool) -> SubmitResult:
    record = load_run(run_dir)
    require_agent_env(record.agent_env)
    statuses = attempt_statuses(run_dir, record, live_jobs(record))
    units = []
    skipped = []
    for status in statuses:
        lost = status.state == AttemptState.FAILED and (
            status.failure in (FailureClass.INFRASTRUCTURE, FailureClass.IMAGE)
            or status.trial is None
        )
        if lost or (failed and status.state == AttemptState.FAILED):
            units.append(Unit(status.task, status.attempt))
        elif status.state in (AttemptState.PENDING, AttemptState.RUNNING):
            skipped.append(status)
    tasks: dict[str, Task] = {}
    for task_rel in {unit.task for unit in units}:
        loaded = load_task(
            Path(record.tasks_root), record.task_path(task_rel), require_dockerfile=False
        )
        if not isinstance(loaded, Task):
            raise InputError(str(loaded), hint="fix the task, then resubmit again")
        tasks[task_rel] = loaded
    result = _launch(run_dir, record, units, tasks, dry_run=dry_run)
    result.skipped = skipped
    return result


def _launch(
    run_dir: Path,
    record: RunRecord,
    units: list[Unit],
    tasks: dict[str, Task],
    *,
    dry_run: bool,
) -> SubmitResult:
    """Record image problems, group, chunk and size the runnable units, and queue them."""
    executor = choose_executor(str(record.options["executor"]))
    check = reference_check(record.environment_kwargs)
    problems = {
        rel: problem
        for rel in sorted({unit.task for unit in units})
        if (problem := image_problem(tasks[rel], check)) is not None
    }
    runnable = [unit for unit in units if unit.task not in problems]
    groups = plan_groups(record, runnable, tasks, executor)
    result = SubmitResult(run_dir, executor, None, [], runnable, groups, problems, dry_run=dry_run)
    result.environment_kwargs = record.environment_kwargs
    result.agent_kwargs = record.agent_kwargs
    if dry_run:
        return result
    with update_run(run_dir) as fresh:
        for rel in {unit.task for unit in units}:
            fresh.image_problems.pop(rel, None)
        fresh.image_problems.update(problems)
        number = len(fresh.submissions) + 1
        if groups:
            fresh.submissions.append(
                Submission(
                    number=number,
                    executor=executor,
                    host=socket.gethostname(),
                    submitted_at=now_iso(),
                    chunks=[
                        Chunk(chunk, resources=group.resources.to_json())
                        for group in groups
                        for chunk in group.chunks
                    ],
                )
            )
    if not groups:
        return result
    result.submission = number
    queued = 0
    try:
        # Each array's ids are recorded as soon as Slurm gives them, so that a refusal of a
        # later array leaves the earlier ones known to status and resubmit.
        for job_ids in _queue(run_dir, record, number, groups, executor):
            with update_run(run_dir) as fresh:
                submission = fresh.submissions[number - 1]
                for chunk, job_id in zip(submission.chunks[queued:], job_ids, strict=False):
                    chunk.job = job_id
                queued += len(job_ids)
                result.job_ids = submission.job_ids
    except HarborHpcError as exc:
        if queued == 0 and number == 1:
            _forget_run(run_dir)  # nothing ran: the same submit can simply be run again
        elif queued:
            exc.exit_code = 1  # earlier arrays run: a partial failure, whatever stopped the rest
        raise
    return result


def _forget_run(run_dir: Path) -> None:
    paths = RunPaths(run_dir)
    for path in (paths.record, paths.lock):
        path.unlink(missing_ok=True)
    shutil.rmtree(paths.submitit, ignore_errors=True)


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
    limits = None if local or not units else cluster.partition_limits(options.get("partition"))
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
        group = Group(_resources(options, group_tasks, trials, limits), chunks)
        if not local:
            group.requeue_warning_s = cluster.requeue_warning_s(group.resources.time_min)
            working_s = group.resources.time_min * 60 - group.requeue_warning_s
            budgets = {task.rel: trial_budget_sec(task) for task in group_tasks}
            group.too_long = {
                rel: math.ceil(budget)
                for rel, budget in sorted(budgets.items())
                if budget > working_s
            }
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
    options: dict[str, Any], tasks: list[Task], trials: int, limits: NodeLimits | None
) -> Resources:
    """What the user gave, passed on as is; the rest derived from `tasks` and cut to fit the
    partition's biggest node (`limits`)."""
    element = element_resources(tasks, trials=trials, concurrency=int(options["concurrency"]))
    if "gres" in parse_sbatch_args(list(options.get("sbatch_args") or [])):
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


def _queue(
    run_dir: Path,
    record: RunRecord,
    number: int,
    groups: list[Group],
    executor: Executor,
) -> Iterator[list[str]]:
    """Submit each group's chunks, in order, as array jobs of their resources (several when
    MaxArraySize is smaller); yields the element job ids of each array as it is queued."""
    options = record.options
    limit = cluster.max_array_size() if executor is Executor.SLURM else None
    worker = ChunkWorker(str(run_dir), number, int(options["concurrency"]))
    for group in groups:
        request = JobRequest(
            name=f"harbor-hpc:{run_dir.name}",
            time_min=group.resources.time_min,
            mem_mb=group.resources.mem_mb,
            cpus=group.resources.cpus,
            gpus=group.resources.gpus,
            gpu_type=next(iter(group.resources.gpu_types), None),
            partition=options.get("partition"),
            account=options.get("account"),
            qos=options.get("qos"),
            array_parallelism=options.get("array_parallelism"),
            sbatch=parse_sbatch_args(list(options.get("sbatch_args") or [])),
        )
        pool = cluster.executor(RunPaths(run_dir).submitit / "%j", executor, request)
        for part in chunked(group.chunks, limit or len(group.chunks)):
            jobs = cluster.submit_array(
                pool,
                worker,
                [[u.to_json() for u in chunk] for chunk in part],
                what="the run's array job",
                hint="check --partition/--account/--qos and the resources",
            )
            yield [job.job_id for job in jobs]
