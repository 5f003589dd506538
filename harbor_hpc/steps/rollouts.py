"""Rollouts from Python, for trainers: run a folder of tasks N times, get the records back.

    from harbor_hpc.api import RolloutRequest, run_rollouts, stream_rollouts

    request = RolloutRequest(
        tasks=Path("tasks"), run_dir=Path("runs/step-0042"), agent="terminus-2",
        model="openai/policy", agent_kwargs={"api_base": "http://10.0.0.5:8000/v1"},
        agent_env=["OPENAI_API_KEY"], attempts=8, concurrency=4, format="harbor-rl",
    )
    lines = run_rollouts(request, progress=print)     # all of them, at the end
    async for line in stream_rollouts(request):       # or each as its attempt ends
        ...

It is `submit --wait` then `export`, through the very same code, on any backend: the trials run
in harbor-hpc's Apptainer environment as local processes of this machine (a trainer's own
allocation), as Slurm array jobs (`executor="slurm"`), or driven from local processes here with
their containers on a Ray cluster's nodes (`executor="ray"`, the `ray` extra: the cluster of
`harbor-hpc ray up`, or `environment_kwargs={"ray_address": ...}`). The run folder is a run
like any other on every backend (`status`, `resubmit`, `export` work on it).

Everything a user can get wrong is raised once, before anything is queued, as an `InputError`
that names the request's fields (not the CLI's flags): an unknown `format` or `executor`, a
task without its image, a model server that does not answer, does not serve the model or sends
no token ids (`model_server.py`), a Ray cluster that does not answer (in one bounded wait, not
once per environment).

A batch ends when every attempt has, or at its `deadline_s`: what is still running then is
cancelled (its trials end `failed`, infrastructure, with a message that says so; `resubmit`
runs them again) and the lines of what finished are returned. Leaving `stream_rollouts` early
(a `break`) cancels what is left the same way, and returns once those trials have ended (a few
seconds), so that the run's status is final. Each line is an attempt that counts, in
`format`; `trainable` says whether its reward is valid (Harbor's error policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from harbor_hpc.containers.environment_kwargs import ENVIRONMENT
from harbor_hpc.core.errors import HarborHpcError, InputError, choice
from harbor_hpc.results.classify import AttemptState
from harbor_hpc.results.export import ExportFormat, rollout_lines
from harbor_hpc.results.status import RunStatus
from harbor_hpc.slurm.cluster import Executor
from harbor_hpc.steps.runs import cancel_run, follow
from harbor_hpc.steps.submit.launch import submit_run
from harbor_hpc.steps.submit.options import configured_options

RAY_ENVIRONMENT = "harbor_hpc.environment:RaySingularityEnvironment"


class Backend(StrEnum):
    """Where a batch's trials run: local processes here, Slurm array jobs (`auto`: Slurm where
    sbatch is), or local processes here whose containers run on a Ray cluster's nodes."""

    LOCAL = "local"
    SLURM = "slurm"
    AUTO = "auto"
    RAY = "ray"

    @property
    def executor(self) -> Executor:
        return Executor.LOCAL if self is Backend.RAY else Executor(self.value)

    @property
    def environment(self) -> str:
        return RAY_ENVIRONMENT if self is Backend.RAY else ENVIRONMENT


@dataclass
class RolloutRequest:
    """What to run: every task under `tasks`, `attempts` times each, into `run_dir` (new, or
    the same run again to add nothing but what is missing). Fields left None take the value
    harbor-hpc.toml gives the option of that name, as the CLI's flags do, else its default.
    `format` and `executor` take their enum members or their string values; anything else is
    refused here, when the request is made."""

    tasks: Path
    run_dir: Path
    agent: str
    model: str | None = None
    agent_kwargs: dict[str, Any] = field(default_factory=dict)
    # Names of variables the agent gets from this process's environment (API keys).
    agent_env: list[str] = field(default_factory=list)
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    attempts: int = 1
    # Local processes of this machine (a trainer's own allocation), "slurm" for array jobs,
    # "ray" for containers on a Ray cluster's nodes (Backend).
    executor: Backend | str = Backend.LOCAL
    # None: from harbor-hpc.toml (cache_dir also from $HARBOR_HPC_CACHE), else the default.
    cache_dir: Path | None = None
    scratch_dir: Path | None = None
    concurrency: int | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int | None = None
    # Shell lines every Slurm job of the batch runs first (`module load apptainer`).
    setup: list[str] | None = None
    # Each Slurm element's memory in MB and its CPUs (None: sized from its trials, as submit
    # sizes them), and sbatch options beyond those (`--gres=gpu:1`, `--constraint=...`).
    mem_mb: int | None = None
    cpus: int | None = None
    sbatch_args: list[str] | None = None
    format: ExportFormat | str = ExportFormat.FULL
    # Seconds from the submission after which what has not finished is cancelled.
    deadline_s: float | None = None
    # Ask the model server before the batch (False where only the compute nodes reach it).
    model_check: bool = True
    # The key of the verifier's reward.json that is each trial's reward; None: `reward`, else
    # a lone value; several and none of them `reward`: not trainable (docs/results.md).
    reward_key: str | None = None
    # Into a run_dir whose tasks changed since it ran them: run the changed tasks again
    # rather than raise `TaskChangedError`.
    rerun_changed: bool = False

    def __post_init__(self) -> None:
        for name in ("tasks", "run_dir"):
            if not isinstance(getattr(self, name), str | os.PathLike):
                raise InputError(
                    f"{name} must be a path, not {type(getattr(self, name)).__name__} "
                    f"{getattr(self, name)!r}"
                )
        self.tasks = Path(self.tasks)
        self.run_dir = Path(self.run_dir)
        for name in ("agent", "model"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "model" and value is None):
                raise InputError(f"{name} must be a string, not {value!r}")
        self.format = choice(ExportFormat, self.format, "format")
        self.executor = choice(Backend, self.executor, "executor")
        for name in ("agent_kwargs", "environment_kwargs"):
            if not isinstance(getattr(self, name), dict):
                value = getattr(self, name)
                raise InputError(
                    f"{name} must be a dict of names to values, not {type(value).__name__} "
                    f"{value!r}",
                    hint=f'{name}={{"name": value}}',
                )
        self.agent_kwargs = recordable(self.agent_kwargs, "agent_kwargs")
        self.environment_kwargs = recordable(self.environment_kwargs, "environment_kwargs")
        if self.deadline_s is not None and (
            isinstance(self.deadline_s, bool)
            or not isinstance(self.deadline_s, int | float)
            or self.deadline_s <= 0
        ):
            raise InputError(
                f"deadline_s must be a number of seconds above 0, not {self.deadline_s!r}"
            )
        for name in ("model_check", "rerun_changed"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if self.reward_key is not None and (
            not isinstance(self.reward_key, str) or not self.reward_key.strip()
        ):
            raise InputError(
                f"reward_key must name a key of the verifier's reward.json, not "
                f"{self.reward_key!r}",
                hint='e.g. reward_key="correct", or None for `reward`',
            )
        for name in ("agent_env", "setup", "sbatch_args"):
            value = getattr(self, name)
            if isinstance(value, str):  # each character would be one item
                raise InputError(
                    f"{name} must be a list of strings, not the string {value!r}",
                    hint=f"{name}=[{value!r}]",
                )
            if value is not None and (
                not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value)
            ):
                raise InputError(f"{name} must be a list of strings, not {value!r}")
        for name, least in WHOLE_NUMBERS.items():
            value = getattr(self, name)
            if (value is not None or name == "attempts") and (
                isinstance(value, bool) or not isinstance(value, int) or value < least
            ):
                raise InputError(
                    f"{name} must be a whole number of at least {least}, not {value!r}",
                    hint="or None, to have each element sized from its trials"
                    if name in ("mem_mb", "cpus")
                    else None,
                )


# The request's whole-number fields and the least each takes (None: from harbor-hpc.toml, or
# sized from the trials; `attempts` takes no None).
WHOLE_NUMBERS = {"attempts": 1, "concurrency": 1, "time_min": 1, "mem_mb": 1, "cpus": 1}


def recordable(kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    """`kwargs` as the run records them (JSON): paths become their text; a value JSON cannot
    hold is refused by its key."""
    taken = {
        key: os.fspath(value) if isinstance(value, os.PathLike) else value
        for key, value in kwargs.items()
    }
    for key, value in taken.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise InputError(
                f"{name}[{key!r}] is of type {type(value).__name__}, which a run cannot record",
                hint="give a str, number, bool, None, or a list or dict of those",
            ) from None
    return taken


@dataclass(frozen=True)
class Progress:
    """Where a batch stands: attempts done (ended with a reward), failed, running, pending."""

    done: int
    failed: int
    running: int
    pending: int
    total: int
    # Why the pending ones wait, once they have waited a minute: Slurm's reasons, with how
    # many attempts each holds back ("Slurm: Resources (12)").
    waiting: str | None = None

    @classmethod
    def of(cls, status: RunStatus) -> Progress:
        states = status.summary.states
        waiting = ", ".join(f"{why} ({n})" for why, n in status.summary.waiting.items())
        return cls(
            done=states[AttemptState.DONE],
            failed=states[AttemptState.FAILED],
            running=states[AttemptState.RUNNING],
            pending=states[AttemptState.PENDING],
            total=status.summary.total,
            waiting=waiting or None,
        )


ProgressCallback = Callable[[Progress], None]


def run_rollouts(
    request: RolloutRequest, *, progress: ProgressCallback | None = None
) -> list[dict[str, Any]]:
    """Run the request's trials to the end (or its deadline) and return the rollout lines of
    the attempts that count, in `request.format`; `progress` is called whenever the counts
    change. Raises `HarborHpcError` (`InputError` for a wrong setting) before the batch."""
    batches = follow_rollouts(request, progress=progress, streaming=False)
    return [line for batch in batches for line in batch]


async def stream_rollouts(
    request: RolloutRequest, *, progress: ProgressCallback | None = None
) -> AsyncGenerator[dict[str, Any]]:
    """The lines of `run_rollouts`, each group's (a task's attempts) as soon as its last
    attempt has ended, every line with its group's final verdict, for a trainer's
    event loop (the waiting happens in a thread; `progress` is called from it). Leaving the
    loop early cancels what has not finished."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[list[dict[str, Any]] | BaseException | None] = asyncio.Queue()
    stop = threading.Event()

    def pump() -> None:
        batches = follow_rollouts(request, progress=progress)
        try:
            for batch in batches:
                if stop.is_set():
                    break
                loop.call_soon_threadsafe(queue.put_nowait, batch)
        except BaseException as exc:
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            batches.close()  # cancels what is left when the caller stopped early
            loop.call_soon_threadsafe(queue.put_nowait, None)

    worker = asyncio.create_task(asyncio.to_thread(pump))
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            for line in item:
                yield line
    finally:
        stop.set()
        await asyncio.shield(worker)


def follow_rollouts(
    request: RolloutRequest, *, progress: ProgressCallback | None = None, streaming: bool = True
) -> Generator[list[dict[str, Any]]]:
    """Submit the batch, then at every look at the run the lines of the attempts that ended
    since the last (often none); without `streaming`, every line once, at the end, when each
    group's verdict is final. Closing the generator before the end cancels the rest."""
    backend = Backend(request.executor)  # made one in __post_init__
    with python_words():
        options = configured_options(
            None,  # harbor-hpc.toml here, as the CLI reads it
            agent=request.agent,
            model=request.model,
            agent_kwargs=dict(request.agent_kwargs),
            agent_env=list(request.agent_env),
            environment_kwargs=dict(request.environment_kwargs),
            cache_dir=request.cache_dir,
            scratch_dir=request.scratch_dir,
            executor=backend.executor,
            environment=backend.environment,
            partition=request.partition,
            account=request.account,
            qos=request.qos,
            time_min=request.time_min,
            setup=request.setup,
            sbatch_args=request.sbatch_args,
            mem_mb=request.mem_mb,
            cpus=request.cpus,
            attempts=request.attempts,
            concurrency=request.concurrency,
            model_check=request.model_check,
            reward_key=request.reward_key,
            rerun_changed=request.rerun_changed,
            require_images=True,
        )
        # One process (or element) runs `concurrency` trials at once.
        options = replace(options, tasks_per_job=options.concurrency)
        result = submit_run(request.tasks, request.run_dir, options)
    run_dir = result.run_dir
    deadline = None if request.deadline_s is None else time.monotonic() + request.deadline_s
    reported: set[tuple[str, int]] = set()
    seen: Progress | None = None
    finished = cancelled = False
    try:
        for status in _in_python_words(follow(run_dir)):
            now = Progress.of(status)
            if progress is not None and now != seen:
                progress(now)
            seen = now
            finished = status.summary.finished
            if streaming or finished:
                yield _new_lines(run_dir, status, reported, request.format)
            if deadline is not None and time.monotonic() > deadline and not finished:
                cancel_run(run_dir)
                cancelled = True
                break
        if cancelled:  # the lines of what the deadline stopped, once it has ended
            settled = _settle(run_dir, progress)
            yield _new_lines(run_dir, settled, reported, request.format, whole_groups=False)
    finally:
        if not (finished or cancelled):  # the caller stopped early: the rest is not wanted
            cancel_run(run_dir)
            _settle(run_dir, progress)


def _in_python_words[T](statuses: Iterator[T]) -> Iterator[T]:
    """`statuses`, whose errors (a job Slurm will never start) speak to a Python caller."""
    with python_words():
        yield from statuses


def _new_lines(
    run_dir: Path,
    status: RunStatus,
    reported: set[tuple[str, int]],
    fmt: ExportFormat | str,
    *,
    whole_groups: bool = True,
) -> list[dict[str, Any]]:
    """The lines (those that count) of the groups (a task's attempts) whose every attempt has
    ended, less those in `reported`, which they join: each line carries its group's final
    verdict (`group_trainable`), even where a trainer format leaves an untrainable member out.
    Without `whole_groups` (the batch's last look, after a cancel), whatever has ended."""
    ended = [
        s
        for s in status.attempts
        if s.state in (AttemptState.DONE, AttemptState.FAILED)
        and (s.task, s.attempt) not in reported
    ]
    if whole_groups:
        waiting = {
            s.task
            for s in status.attempts
            if s.state in (AttemptState.PENDING, AttemptState.RUNNING)
        }
        ended = [s for s in ended if s.task not in waiting]
    reported.update((s.task, s.attempt) for s in ended)
    lines = rollout_lines(run_dir, ended, fmt=fmt, groups=status.attempts)[0] if ended else []
    return [line for line in lines if line.get("counts", True)]


def _settle(run_dir: Path, progress: ProgressCallback | None) -> RunStatus:
    """The run's status once what a cancel stopped has ended (or after SETTLE_S), told to
    `progress` as well: final when the caller goes on. Looked at every second (squeue every
    two): the trials a cancel stops end within seconds of it."""
    until = time.monotonic() + SETTLE_S
    statuses = follow(run_dir, every_s=1, squeue_every_s=2)  # ends with a finished status
    status = next(statuses)
    while not status.summary.finished and time.monotonic() <= until:
        status = next(statuses)
    if progress is not None:
        progress(Progress.of(status))
    return status


# How long leaving a batch early waits for the trials it cancelled to end.
SETTLE_S = 60.0

# The CLI's words in messages and hints, and what a caller of this module calls them.
_COMMANDS = {
    "`harbor-hpc resubmit`": "`harbor_hpc.api.resubmit_run(run_dir)`",
    "`harbor-hpc submit`": "`harbor_hpc.api.run_rollouts` (or `submit_run`)",
    "`harbor-hpc status`": "`harbor_hpc.api.run_status(run_dir)`",
    "`harbor-hpc doctor`": "`harbor-hpc doctor` (a command)",
}
_FLAG = re.compile(r"--([a-z][a-z-]*)")
# Flags whose field has another name.
_FLAG_FIELDS = {"mem": "mem_mb", "time": "time_min", "sbatch_arg": "sbatch_args"}


def _field(match: re.Match[str]) -> str:
    """The request's field a flag sets; a flag of another command (`rewrite --sif`, in a hint
    to run it) as it is."""
    names = {f.name for f in fields(RolloutRequest)}
    name = match.group(1).replace("-", "_")
    name = _FLAG_FIELDS.get(name, name)
    if name.startswith("no_") and name[3:] in names:  # --no-model-check
        return f"{name[3:]}=False"
    for candidate in (name, f"{name}s"):  # --agent-kwarg: agent_kwargs
        if candidate in names:
            return candidate
    return match.group(0)


def in_python_words(text: str) -> str:
    """`text` with the CLI's flags named as the request's fields, its commands as functions."""
    for command, function in _COMMANDS.items():
        text = text.replace(command, function)
    return _FLAG.sub(_field, text)


@contextlib.contextmanager
def python_words() -> Iterator[None]:
    """Errors raised inside speak to a Python caller: fields and functions, not flags."""
    try:
        yield
    except HarborHpcError as exc:
        exc.message = in_python_words(exc.message)
        exc.args = (exc.message,)
        exc.hint = in_python_words(exc.hint) if exc.hint else exc.hint
        raise
