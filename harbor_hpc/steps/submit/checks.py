"""What submit refuses before it records or queues anything: an agent or environment that
cannot be made with what was given, kwargs that look like secrets, variables the agent would
miss, tasks without what Harbor's verifier runs, and tasks whose image no node could get. None
of them changes anything."""

from __future__ import annotations

import functools
import inspect
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harbor_hpc.containers.environment_kwargs import (
    accepted_environment_kwargs,
    flag,
    option_names,
)
from harbor_hpc.containers.store import sif_file, unavailable
from harbor_hpc.containers.tools import AGENT_TOOLS, missing_tools
from harbor_hpc.core.config import Config, cache_dir
from harbor_hpc.core.errors import InputError
from harbor_hpc.core.files import read_in_threads
from harbor_hpc.core.imports import cannot_import, import_class
from harbor_hpc.ray.environment import RaySingularityEnvironment
from harbor_hpc.slurm.worker import use_local_cost_map
from harbor_hpc.steps.submit.options import CACHE_KWARG, ROLLOUT_KWARG
from harbor_hpc.tasks.discovery import Task

ReferenceCheck = Callable[[str], str | None]
ToolsCheck = Callable[[Path], list[str]]


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


def tools_check(agent: str) -> ToolsCheck:
    """What a .sif lacks of the programs `agent` runs in the container (containers/tools.py),
    asked once per image."""
    tools = AGENT_TOOLS.get(agent, ())
    return functools.cache(lambda sif: missing_tools(sif, tools))


def image_problem(task: Task, check: ReferenceCheck, tools: ToolsCheck | None = None) -> str | None:
    """Why `task` cannot run for want of an image (its own, or its separate verifier's), or None
    when its images are there to use: a .sif that exists (with what the agent runs in it, as
    `tools` says), or a reference a node can get."""
    image = task.docker_image
    if not image:
        return (
            f"{task.task_toml}: no environment.docker_image (run `harbor-hpc build`, then "
            "`harbor-hpc rewrite --sif`; after a Docker build, `harbor-hpc convert` before it)"
        )
    problem = _image_problem(image, task.environment_dir, check, tools)
    if problem is not None:
        return f"{task.task_toml}: docker_image {problem}"
    return _verifier_image_problem(task, check)


def _image_problem(
    image: str, folder: Path, check: ReferenceCheck, tools: ToolsCheck | None = None
) -> str | None:
    sif = sif_file(image, folder)
    if sif is not None:
        if not sif.is_file():
            return (
                f"{image} does not exist (build or convert into that store, or run "
                "`harbor-hpc rewrite --sif` with the manifest that has its .sif)"
            )
        lacking = tools(sif) if tools is not None else []
        if lacking:
            return (
                f"{image} has no {' or '.join(lacking)}, which the agent runs in the container "
                f"(add {' and '.join(lacking)} to the image: `RUN apt-get install -y "
                f"{' '.join(lacking)}` in its Dockerfile, then build and convert again)"
            )
        return None
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


# Harbor's words for a test script a task lacks (harbor/models/task/task.py, _validate_tests).
_NO_TEST = re.compile(r"does not contain (\S+?)\.$")
_EXPECTED = re.compile(r"Expected (\S+) or (\S+?)\.$")


def verifier_problem(task: Task) -> str | None:
    """Why Harbor's trial of `task` would refuse it before anything ran (no tests/test.sh, no
    instruction.md, a step's folder missing), in one line naming the task, or None when it
    would not: the check Harbor's Task makes, asked here so that a batch never starts with it."""
    from harbor.models.task.paths import TaskPaths
    from harbor.models.task.task import Task as HarborTask

    try:
        HarborTask._validate_tests(task.config, TaskPaths(task.path))
    except (OSError, ValueError, RuntimeError) as exc:
        said = " ".join(str(exc).split())
        if (missing := _NO_TEST.search(said)) or (missing := _EXPECTED.search(said)):
            script = " or ".join(missing.groups())
            return (
                f"task {task.rel}: {script} is missing: Harbor's verifier runs it to give the "
                f"reward (add {script} to {task.path}, writing /logs/verifier/reward.txt, or "
                "remove the task)"
            )
        return f"task {task.rel}: {said.replace(f'Task directory {task.path} ', '')}"
    return None


def refuse_unverifiable(tasks: list[Task]) -> None:
    """Refuse the batch when a task lacks what Harbor's verifier runs (`verifier_problem`),
    asked of every task, several at a time (a shared filesystem's round trips)."""
    problems = [problem for problem in read_in_threads(verifier_problem, tasks) if problem]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise InputError(
            "; ".join(problems[:5]) + more,
            hint="fix or remove these tasks; nothing was queued",
        )


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
def check_environment(environment: str, kwargs: dict[str, Any]) -> type:
    """Refuse an environment that does not import, or kwargs it does not take; the class."""
    found = import_class("--environment", environment)
    accepted = accepted_environment_kwargs(found)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise InputError(
            f"--environment-kwarg {', '.join(unknown)}: not accepted by {environment}, which "
            f"takes: {', '.join(accepted) or 'none'}"
        )
    _check_values(found, environment, kwargs)
    return found


def preflight(found: type, kwargs: dict[str, Any], *, here: bool) -> None:
    """The environment class's preflight, as Harbor calls it before a job, where it checks what
    the batch uses: for environments that run `here` (the local executor: no container runtime
    on this node, say), and for those on a Ray cluster (a cluster that does not answer). A
    Slurm batch's nodes are not this one: their trials say what they lack."""
    on_ray = issubclass(found, RaySingularityEnvironment)
    check = getattr(found, "preflight", None)  # Harbor's BaseEnvironment has one
    if not (here or on_ray) or check is None:
        return
    try:
        check(kwargs)
    except SystemExit as refused:
        said = str(refused.code)
        hint = None
        if on_ray and "ray up" not in said:
            hint = "start one with `harbor-hpc ray up`, or fix --environment-kwarg ray_address "
            hint += "(or ray_cluster_dir)"
        raise InputError(said, hint=hint) from None


def check_scratch(scratch: Path, environment: str) -> None:
    """Refuse a --scratch-dir that trials on this machine (the local executor) cannot write, before
    anything runs; on Slurm or Ray it is each node's own folder, which only the nodes can judge."""
    if issubclass(import_class("--environment", environment), RaySingularityEnvironment):
        return
    path = scratch.expanduser()
    if path.exists() and not path.is_dir():
        raise InputError(f"--scratch-dir {scratch}: not a folder", hint=SCRATCH_HINT)
    nearest = path
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    if not os.access(nearest, os.W_OK | os.X_OK):
        held = "" if nearest == path else f" (of {nearest}, where it would be made)"
        raise InputError(f"--scratch-dir {scratch}: you cannot write it{held}", hint=SCRATCH_HINT)


SCRATCH_HINT = "name a folder of yours on a local disk with room, or leave it out ($TMPDIR)"


def _check_values(found: Any, environment: str, kwargs: dict[str, Any]) -> None:
    """Refuse a kwarg's value that Harbor's parsing of the environment's typed options refuses,
    here, in one line, rather than in every trial's start."""
    typed = {name: kwargs[name] for name in option_names(found) if name in kwargs}
    try:
        found.parse_options(typed)
    except ValueError as exc:
        # Harbor's lines: a heading, `  option[.union branch]: why` each, a pointer; each
        # branch's why said under its option.
        said = []
        for line in str(exc).splitlines():
            if line.startswith("  "):
                where, _, why = line.strip().partition(": ")
                said.append(f"{where.split('.')[0]}: {why}" if why else where)
        names = dict.fromkeys(line.split(":")[0] for line in said)
        given = ", ".join(f"{name}={typed[name]!r}" for name in names if name in typed)
        raise InputError(
            f"--environment-kwarg {given or 'values'} refused: "
            + ("; ".join(dict.fromkeys(said)) or str(exc)),
            hint=f"`harbor environment schema {environment}` lists the options and their types",
        ) from None


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


def agent_env(specs: list[str]) -> dict[str, str | None]:
    """`--agent-env NAME[=VALUE]` as each name with the value given (None: the one in this
    process's environment, which must be set). Nothing is put anywhere: the values reach the
    jobs' environment when they are queued (`launch`), never a file."""
    given: dict[str, str | None] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise InputError(
                f"--agent-env {name!r} is not a variable name", hint="e.g. OPENAI_API_KEY"
            )
        given[name] = value if sep else given.get(name)
    require_agent_env(list(given), given)
    return given


def require_agent_env(names: list[str], given: Mapping[str, str | None] | None = None) -> None:
    """Refuse to queue a run whose agent would miss variables the caller did not set (in this
    process's environment, or a value `given`)."""
    unset = [name for name in names if name not in os.environ and (given or {}).get(name) is None]
    if unset:
        raise InputError(
            f"--agent-env {', '.join(unset)}: not set in your environment",
            hint="export it first, or pass --agent-env NAME=VALUE (a run records the names of "
            "its secrets, never their values: resubmitting needs them set again)",
        )
