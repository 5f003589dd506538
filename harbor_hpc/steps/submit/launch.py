"""Submit a run (`submit`) or what is left of one (`resubmit`) as submitit array jobs.

The checks come first (`checks`), then the plan (`plan`), which is written to `run.json` before
anything is queued, so a run whose submission is interrupted still says what it was meant to
be; the job ids are added as soon as Slurm hands them out. Tasks whose image is missing are
recorded and not submitted. Tasks that ask for different resources go out as arrays of their
own, each element sized for its tasks.
"""

from __future__ import annotations

import contextlib
import getpass
import shutil
import socket
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.files import LockTimeout, file_lock
from harbor_hpc.results.classify import AttemptState, FailureClass
from harbor_hpc.results.record import (
    Chunk,
    RunPaths,
    RunRecord,
    Submission,
    Unit,
    check_run_folder,
    create_run,
    load_run,
    make_private,
    now_iso,
    read_task_hashes,
    record_task_hashes,
    update_run,
)
from harbor_hpc.results.status import AttemptStatus, attempt_statuses
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, choose_executor
from harbor_hpc.slurm.runs import live_jobs
from harbor_hpc.steps.submit.checks import (
    agent_class,
    agent_env,
    check_agent,
    check_environment,
    check_scratch,
    default_agent_kwargs,
    image_problem,
    preflight,
    reference_check,
    refuse_secrets,
    refuse_unverifiable,
    require_agent_env,
    tools_check,
)
from harbor_hpc.steps.submit.model_server import check_model_server, check_route
from harbor_hpc.steps.submit.options import (
    SubmitOptions,
    placed_environment_kwargs,
)
from harbor_hpc.steps.submit.plan import Group, plan_groups
from harbor_hpc.steps.submit.waves import SUBMIT_LIMIT_REACHED, agent_env_values, queue_chunks
from harbor_hpc.tasks.digest import Digest, changed_parts, describe_changes, task_digests
from harbor_hpc.tasks.discovery import Task, discover_tasks, load_task


class TaskChangedError(InputError):
    """Tasks of a run changed since the run recorded them (their instruction, task.toml,
    tests, environment; the solution for the oracle agent): their trials answer for the task
    as it was, so the run is not continued with them unless asked to run them again."""

    def __init__(self, run_dir: Path, changes: list[tuple[str, list[str]]]) -> None:
        super().__init__(
            f"{run_dir}: {len(changes)} task(s) changed since this run ran them: "
            f"{describe_changes(changes)}; their finished trials are of the old task",
            hint="pick a new --run-dir, or pass --rerun-changed to run the changed tasks again "
            "in this one",
        )
        self.run_dir = run_dir
        self.tasks = [task for task, _ in changes]


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
    # How many elements were queued now (a dry run: would be), and why the others wait to be
    # (None: none waits).
    queued: int = 0
    waiting: str | None = None
    # Tasks that changed since the run ran them, run again (`--rerun-changed`).
    rerun: list[str] = field(default_factory=list)

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
            "queued": self.queued,
            "waiting": self.waiting,
            "rerun": self.rerun,
        }


def submit_run(
    tasks_dir: Path, run_dir: Path, options: SubmitOptions, *, dry_run: bool = False
) -> SubmitResult:
    """Discover the tasks, record the run in `run_dir`, and queue every task attempt."""
    if options.tasks_per_job < 1 or options.concurrency < 1 or options.attempts < 1:
        raise InputError("--tasks-per-job, --concurrency and --attempts must be at least 1")
    if options.reward_key is not None and (
        not isinstance(options.reward_key, str) or not options.reward_key.strip()
    ):
        raise InputError(
            f"--reward-key must name a key of the verifier's reward.json, not "
            f"{options.reward_key!r}"
        )
    agent = agent_class(options.agent)
    agent_kwargs = default_agent_kwargs(agent, options.agent_kwargs)
    refuse_secrets(options.agent_kwargs, "--agent-kwarg")
    refuse_secrets(options.environment_kwargs, "--environment-kwarg")
    environment_kwargs = placed_environment_kwargs(options)
    environment = check_environment(options.environment, environment_kwargs)
    executor = choose_executor(options.executor)
    scratch = environment_kwargs.get("scratch_dir")  # --scratch-dir, or an environment kwarg
    if executor is Executor.LOCAL and scratch:
        check_scratch(Path(str(scratch)), options.environment)
    run_dir = run_dir.expanduser().absolute()
    check_run_folder(run_dir, write=True)
    discovery = discover_tasks(tasks_dir, require_dockerfile=False)
    if discovery.problems:
        raise InputError(
            "some tasks cannot be read:\n  " + "\n  ".join(str(p) for p in discovery.problems),
            hint="fix or remove these task folders",
        )
    if not discovery.tasks:
        raise InputError(f"{tasks_dir}: no tasks (folders with task.toml) found")
    refuse_unverifiable(discovery.tasks)
    check_agent(agent, options.agent, options.model, agent_kwargs, discovery.tasks[0])
    given_env = agent_env(options.agent_env)
    values = {name: value for name, value in given_env.items() if value is not None}
    agent_env_values[run_dir.expanduser().absolute()] = values
    if options.require_images:
        check, tools = reference_check(environment_kwargs), tools_check(options.agent)
        missing = [p for task in discovery.tasks if (p := image_problem(task, check, tools))]
        if missing:
            raise InputError(
                f"{len(missing)} task(s) have no image to run: " + "; ".join(missing[:5]),
                hint="build, convert or rewrite them first; nothing was queued",
            )
    check_route(options.model, agent_kwargs)
    # A dry run queues nothing here: what this node lacks to run the trials is not asked.
    preflight(environment, environment_kwargs, here=executor is Executor.LOCAL and not dry_run)
    if options.model_check:
        check_model_server(options.model, agent_kwargs, values)
    record = RunRecord(
        tasks_root=str(discovery.root),
        tasks=[task.rel for task in discovery.tasks],
        agent=options.agent,
        model=options.model,
        agent_kwargs=agent_kwargs,
        agent_env=sorted(given_env),
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
            return _resubmit(
                run_dir,
                failed=False,
                dry_run=dry_run,
                env=values,
                rerun_changed=options.rerun_changed,
            )
        now = _digests(run_dir, record)
        digests = {task: digest for task, digest in now.items() if digest is not None}
        if not dry_run:
            create_run(run_dir, record)
        return _launch(
            run_dir,
            record,
            record.units(),
            discovery.by_rel(),
            dry_run=dry_run,
            env=values,
            digests=digests,
        )


def resubmit_run(
    run_dir: Path, *, failed: bool = False, dry_run: bool = False, rerun_changed: bool = False
) -> SubmitResult:
    """Queue again the attempts without a finished trial (and with `failed`, the failed ones).

    Attempts still pending or running are left alone; done ones are never run again, unless
    their task changed since the run ran it: then the run is refused (`TaskChangedError`), or
    with `rerun_changed` every attempt of the changed tasks runs again.
    """
    run_dir = run_dir.expanduser().absolute()
    if dry_run:
        return _resubmit(run_dir, failed=failed, dry_run=True, rerun_changed=rerun_changed)
    load_run(run_dir)  # a folder without a run is named as such, before any lock file is made
    with only_writer(run_dir):
        return _resubmit(run_dir, failed=failed, dry_run=False, rerun_changed=rerun_changed)


def _digests(run_dir: Path, record: RunRecord) -> dict[str, Digest | None]:
    """Each task's digest now (None: its folder is gone), the run folder left out of any."""
    return task_digests({task: record.task_path(task) for task in record.tasks}, skip=run_dir)


def _changes(
    run_dir: Path, record: RunRecord, now: dict[str, Digest | None]
) -> list[tuple[str, list[str]]]:
    """The tasks whose digest differs from the one the run recorded, with the parts that do
    (a task never recorded, or gone now, is not compared)."""
    recorded = read_task_hashes(run_dir)
    changes = []
    for task in record.tasks:
        old, new = recorded.get(task), now.get(task)
        if old is not None and new is not None:
            parts = changed_parts(old, new, record.agent)
            if parts:
                changes.append((task, parts))
    return changes


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


def _resubmit(
    run_dir: Path,
    *,
    failed: bool,
    dry_run: bool,
    env: Mapping[str, str] | None = None,
    rerun_changed: bool = False,
) -> SubmitResult:
    record = load_run(run_dir)
    require_agent_env(record.agent_env, env)
    now = _digests(run_dir, record)
    changes = _changes(run_dir, record, now)
    if changes and not rerun_changed:
        raise TaskChangedError(run_dir, changes)
    changed = {task for task, _ in changes}
    statuses = attempt_statuses(run_dir, record, live_jobs(record))
    units = []
    skipped = []
    for status in statuses:
        lost = status.state == AttemptState.FAILED and (
            status.failure in (FailureClass.INFRASTRUCTURE, FailureClass.IMAGE)
            or status.trial is None
        )
        if status.task in changed or lost or (failed and status.state == AttemptState.FAILED):
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
    # What the trials queued now run: the changed tasks as they are, and the tasks of a run
    # made before runs recorded digests.
    recorded = read_task_hashes(run_dir)
    digests = {
        task: digest
        for task, digest in now.items()
        if digest is not None and (task in changed or task not in recorded)
    }
    result = _launch(
        run_dir, record, units, tasks, dry_run=dry_run, env=env, rerun=changed, digests=digests
    )
    result.skipped = skipped
    result.rerun = sorted(changed)
    return result


def _launch(
    run_dir: Path,
    record: RunRecord,
    units: list[Unit],
    tasks: dict[str, Task],
    *,
    dry_run: bool,
    env: Mapping[str, str] | None = None,
    rerun: Collection[str] = (),
    digests: Mapping[str, Digest] | None = None,
) -> SubmitResult:
    """Record image problems, group, chunk and size the runnable units, and queue them (with
    `env`, the `--agent-env` values given, in the environment the jobs get); `rerun`: tasks
    that changed, whose trials before this submission no longer count; `digests`: the tasks'
    digests to record (tasks/digest.py) before anything is queued."""
    executor = choose_executor(str(record.options["executor"]))
    check, tools = reference_check(record.environment_kwargs), tools_check(record.agent)
    problems = {
        rel: problem
        for rel in sorted({unit.task for unit in units})
        if (problem := image_problem(tasks[rel], check, tools)) is not None
    }
    runnable = [unit for unit in units if unit.task not in problems]
    groups = plan_groups(record, runnable, tasks, executor)
    result = SubmitResult(run_dir, executor, None, [], runnable, groups, problems, dry_run=dry_run)
    result.environment_kwargs = record.environment_kwargs
    result.agent_kwargs = record.agent_kwargs
    if dry_run:
        result.queued, result.waiting = _would_queue(executor, len(result.chunks))
        return result
    with update_run(run_dir) as fresh:
        for rel in {unit.task for unit in units}:
            fresh.image_problems.pop(rel, None)
        fresh.image_problems.update(problems)
        number = len(fresh.submissions) + 1
        fresh.rerun_from.update(dict.fromkeys(rerun, number))
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
    record_task_hashes(run_dir, dict(digests or {}))
    if not groups:
        return result
    result.submission = number
    try:
        queued = queue_chunks(run_dir, number, env)
    except HarborHpcError as exc:
        if load_run(run_dir).submissions[number - 1].job_ids:
            exc.exit_code = 1  # earlier arrays run: a partial failure, whatever stopped the rest
        elif number == 1:
            _forget_run(run_dir)  # nothing ran: the same submit can simply be run again
        raise
    submission = load_run(run_dir).submissions[number - 1]
    result.job_ids, result.waiting = submission.job_ids, submission.waiting
    result.queued = queued
    return result


def _would_queue(executor: Executor, elements: int) -> tuple[int, str | None]:
    """How many of `elements` the cluster would take now, and why the others would wait."""
    room = cluster.submit_room(getpass.getuser()) if executor is Executor.SLURM else None
    if room is None or room >= elements:
        return elements, None
    return room, SUBMIT_LIMIT_REACHED


def _forget_run(run_dir: Path) -> None:
    """Leave no trace of a run nothing of which was queued: the folder as it was before (gone,
    when submit made it; what else it held stays)."""
    paths = RunPaths(run_dir)
    for path in (paths.record, paths.task_hashes, paths.lock, paths.submit_lock):
        path.unlink(missing_ok=True)  # a lock held still holds: its file may go
    shutil.rmtree(paths.submitit, ignore_errors=True)
    for folder in (paths.markers, paths.trials, run_dir):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty
