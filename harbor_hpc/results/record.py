"""The run folder: what was submitted (`run.json`), what each worker started (markers), trials.

Layout of a run folder:

    run.json              what was asked for: tasks, agent, model, options, every submission
    task-hashes.json      each task's digest as the run last ran it (tasks/digest.py): a changed
                          task is refused or run again, never answered from its old trials
    trials/<trial>/       standard Harbor trial folders (result.json, trial.log, agent/, verifier/),
                          so `harbor view RUN_DIR --jobs` shows them as the job `trials`
    markers/<trial>.json  written by the worker when it starts a trial: task, attempt, job, host
    trials/<trial>/waiting-for.txt  why a started trial waits before its container can start
                          (no Ray node with room yet), while it does: `status` says so
    outcomes/             what each ended trial came to, a file per worker process: a cache
                          of the trials' own files (results/outcomes.py)
    submitit/             submitit's pickles and the jobs' stdout/stderr

The unit of work is a task attempt: `--attempts A` runs every task A times (for pass@k or RL
rollouts), attempt numbers 0..A-1. A trial folder is never reused: a rerun of an attempt (after a
requeue, a dead job or `resubmit`) gets a new trial name, so no finished trial is overwritten.

A run folder is its owner's alone (0700): its trials hold rewards that train models, and agent
logs that may quote what the agent was given. With `--group-readable` the owner's group may read
it (0750), never write; nobody else may even list it. Harbor makes trial folders world-writable
(0777) for Docker's sake: workers seal each trial once Harbor has made it, and when it ends.
The worker's umask is left alone: it would reach the containers, which keep Docker's (022).

`run.json` is shared between the submitting process and `resubmit` runs, so every change goes
through `update_run` (lock, re-read, change, atomic write). Markers have one writer each.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import pwd
import secrets
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.files import atomic_write_json, atomic_write_text, file_lock, read_json

SCHEMA = "harbor-hpc/run/v1"
RUN_FILE = "run.json"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True, order=True)
class Unit:
    """One task attempt: the task's path relative to the tasks root and the attempt number."""

    task: str
    attempt: int

    def to_json(self) -> list[Any]:
        return [self.task, self.attempt]

    @classmethod
    def from_json(cls, data: Any) -> Unit:
        task, attempt = data
        return cls(str(task), int(attempt))


@dataclass
class Chunk:
    """The units one array element runs, that element's job id once submitted, and what it
    asked for (time_min, mem_mb, cpus, gpus): elements of one submission differ when their
    tasks ask for different resources."""

    units: list[Unit]
    job: str | None = None
    resources: dict[str, Any] = field(default_factory=dict)


@dataclass
class Submission:
    """One `submit` or `resubmit`: which units went out, in which jobs, with what resources."""

    number: int
    executor: str
    host: str
    submitted_at: str
    chunks: list[Chunk] = field(default_factory=list)
    # Why its chunks without a job are not queued yet (the user's limit on queued jobs), while
    # some wait to be queued as the user's jobs leave the queue; None when none waits.
    waiting: str | None = None

    @property
    def waits(self) -> bool:
        """Whether chunks of it wait to be queued (`waiting` says why)."""
        return self.waiting is not None and any(chunk.job is None for chunk in self.chunks)

    @property
    def job_ids(self) -> list[str]:
        """The array jobs' ids (`1234` for elements `1234_0`, `1234_1`...), in order."""
        ids: list[str] = []
        for chunk in self.chunks:
            if chunk.job is not None:
                base = chunk.job.split("_", 1)[0]
                if base not in ids:
                    ids.append(base)
        return ids


@dataclass
class RunRecord:
    tasks_root: str
    tasks: list[str]
    agent: str
    model: str | None
    agent_kwargs: dict[str, Any]
    environment: str
    environment_kwargs: dict[str, Any]
    options: dict[str, Any]
    # The names of the variables the agent gets from the job's environment (`--agent-env`):
    # their values, often secrets, are never written down.
    agent_env: list[str] = field(default_factory=list)
    # Tasks that could not be submitted because their image is missing, with the reason.
    image_problems: dict[str, str] = field(default_factory=dict)
    submissions: list[Submission] = field(default_factory=list)
    # Tasks run again because they changed (`--rerun-changed`): the first submission whose
    # trials of the task count; earlier trials answer for the task as it was.
    rerun_from: dict[str, int] = field(default_factory=dict)
    created_at: str = ""
    updated_at: str = ""

    @property
    def group_readable(self) -> bool:
        return bool(self.options.get("group_readable", False))

    @property
    def attempts(self) -> int:
        value: int = self.options.get("attempts", 1)
        return value

    @property
    def reward_key(self) -> str | None:
        """The key of the verifier's rewards that is the trial's reward (`--reward-key`); None:
        `reward`, else a lone value (classify.primary_reward)."""
        value = self.options.get("reward_key")
        return None if value is None else str(value)

    def differences(self, other: RunRecord) -> list[str]:
        """What `other` would run differently: the fields that define a run's trials."""
        fields = (
            *("tasks_root", "tasks", "agent", "model", "agent_kwargs", "agent_env"),
            *("environment", "environment_kwargs", "attempts", "reward_key"),
        )
        return [name for name in fields if getattr(self, name) != getattr(other, name)]

    def counts(self, task: str, submission: int) -> bool:
        """Whether a trial of `task` made by submission number `submission` answers for the
        task as it is (not one run before the task changed and was run again)."""
        return submission >= self.rerun_from.get(task, 0)

    def units(self) -> list[Unit]:
        return [Unit(task, k) for task in self.tasks for k in range(self.attempts)]

    def task_path(self, task: str) -> Path:
        root = Path(self.tasks_root)
        return root if task == "." else root / task

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "tasks_root": self.tasks_root,
            "tasks": self.tasks,
            "agent": self.agent,
            "model": self.model,
            "agent_kwargs": self.agent_kwargs,
            "agent_env": self.agent_env,
            "environment": self.environment,
            "environment_kwargs": self.environment_kwargs,
            "options": self.options,
            "image_problems": self.image_problems,
            "rerun_from": self.rerun_from,
            "submissions": [
                {
                    **{k: v for k, v in asdict(sub).items() if k != "chunks"},
                    "job_ids": sub.job_ids,
                    "chunks": [
                        {
                            "job": chunk.job,
                            "units": [u.to_json() for u in chunk.units],
                            "resources": chunk.resources,
                        }
                        for chunk in sub.chunks
                    ],
                }
                for sub in self.submissions
            ],
            "created_at": self.created_at,
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_json(cls, data: Any, source: Path) -> RunRecord:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise InputError(
                f"{source}: not a harbor-hpc run record (expected schema {SCHEMA!r})",
                hint="pass the run folder that `harbor-hpc submit` created",
            )
        try:
            submissions = [
                Submission(
                    number=int(sub["number"]),
                    executor=str(sub["executor"]),
                    host=str(sub["host"]),
                    submitted_at=str(sub["submitted_at"]),
                    waiting=sub.get("waiting"),
                    chunks=[
                        Chunk(
                            [Unit.from_json(u) for u in chunk["units"]],
                            chunk.get("job"),
                            # Runs submitted before elements were sized per task kept one
                            # size for the whole submission.
                            dict(chunk.get("resources", sub.get("resources", {}))),
                        )
                        for chunk in sub["chunks"]
                    ],
                )
                for sub in data["submissions"]
            ]
            return cls(
                tasks_root=str(data["tasks_root"]),
                tasks=[str(task) for task in data["tasks"]],
                agent=str(data["agent"]),
                model=data.get("model"),
                agent_kwargs=dict(data.get("agent_kwargs", {})),
                agent_env=[str(name) for name in data.get("agent_env", [])],
                environment=str(data["environment"]),
                environment_kwargs=dict(data.get("environment_kwargs", {})),
                options=dict(data["options"]),
                image_problems=dict(data.get("image_problems", {})),
                submissions=submissions,
                rerun_from={str(k): int(v) for k, v in data.get("rerun_from", {}).items()},
                created_at=str(data.get("created_at", "")),
                updated_at=str(data.get("updated_at", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"{source}: malformed run record (bad or missing {exc})") from None


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def record(self) -> Path:
        return self.root / RUN_FILE

    @property
    def lock(self) -> Path:
        return self.root / f".{RUN_FILE}.lock"

    @property
    def task_hashes(self) -> Path:
        """Each task's digest as the run last ran it (`read_task_hashes`)."""
        return self.root / "task-hashes.json"

    @property
    def submit_lock(self) -> Path:
        """Held by a submit or resubmit from planning to the last queued job."""
        return self.root / ".submit.lock"

    @property
    def trials(self) -> Path:
        return self.root / "trials"

    @property
    def markers(self) -> Path:
        return self.root / "markers"

    @property
    def submitit(self) -> Path:
        return self.root / "submitit"

    @property
    def outcomes(self) -> Path:
        """The outcomes index (results/outcomes.py): what each ended trial came to."""
        return self.root / "outcomes"

    @property
    def cancel(self) -> Path:
        """Says which submissions were cancelled; their workers stop their trials."""
        return self.root / "cancel.json"

    @property
    def followed(self) -> Path:
        """Touched at each look at the room under the user's limit on queued jobs while
        `--wait` or the Python API follows the run (steps/submit/launch.py)."""
        return self.root / ".followed"

    def trial(self, name: str) -> Path:
        return self.trials / name

    def marker(self, trial: str) -> Path:
        return self.markers / f"{trial}.json"


def _owner(path: Path) -> str:
    try:
        uid = path.stat().st_uid
    except OSError:
        return "another user"
    try:
        return f"{pwd.getpwuid(uid).pw_name}'s"
    except KeyError:
        return f"uid {uid}'s"


def _mode(path: Path) -> str:
    try:
        return f" (mode {stat.S_IMODE(path.stat().st_mode):04o})"
    except OSError:
        return ""


def run_folder_problem(run_dir: Path, *, write: bool) -> tuple[Path, str] | None:
    """The folder that keeps this user from reading (`write`: making or writing) the run folder
    `run_dir`, and what they may not do there; None when nothing on the way is closed to them:
    the first folder down to it (itself included) they may not enter, else, with `write`, the
    one it would be made in, or itself, where they may not write."""
    nearest = None
    for folder in [*reversed(run_dir.parents), run_dir]:
        if not os.access(folder, os.F_OK):
            break
        nearest = folder
        if not os.access(folder, os.X_OK):
            return folder, "enter it"
    if write and nearest is not None and not os.access(nearest, os.W_OK):
        if nearest == run_dir:
            return run_dir, "write it"
        return nearest, f"make {run_dir.relative_to(nearest)} in it"
    return None


def check_run_folder(run_dir: Path, *, write: bool) -> None:
    """Refuse, in one line, a run folder this user may not read (`write`: make or write),
    naming the folder in the way (`run_folder_problem`), whose it is, and what to do."""
    found = run_folder_problem(run_dir, write=write)
    if found is None:
        return
    folder, how = found
    if not write and folder == run_dir:
        raise InputError(
            f"{run_dir}: you may not read this run folder (it is {_owner(run_dir)}"
            f"{_mode(run_dir).replace(' (', ', ').rstrip(')')}; you are {getpass.getuser()})",
            hint="runs are private to who submitted them; ask the owner for --group-readable",
        )
    if write:
        hint = (
            "pick a --run-dir in a folder of your own (runs/NAME), or ask its owner to let you in"
        )
    else:
        hint = f"ask its owner to let you into {folder}, or pass a run folder you may read"
    raise InputError(
        f"{run_dir}: {folder} is {_owner(folder)}{_mode(folder)} and you "
        f"({getpass.getuser()}) may not {how}",
        hint=hint,
    )


def load_run(run_dir: Path) -> RunRecord:
    paths = RunPaths(run_dir)
    try:
        paths.record.stat()
    except PermissionError:
        check_run_folder(run_dir, write=False)  # the folder in the way, named
        raise InputError(
            f"{run_dir}: you may not read this run folder (its owner's, or private to them)",
            hint="runs are private to who submitted them; ask the owner for --group-readable",
        ) from None
    except OSError:
        pass
    if not run_dir.is_dir():
        raise InputError(
            f"{run_dir}: no such folder",
            hint="pass the folder given to (or printed by) `harbor-hpc submit`",
        )
    if not paths.record.is_file():
        raise InputError(
            f"{run_dir}: no {RUN_FILE} here, so not a harbor-hpc run folder",
            hint="pass the folder given to (or printed by) `harbor-hpc submit`",
        )
    return RunRecord.from_json(read_json(paths.record), paths.record)


def save_run(run_dir: Path, record: RunRecord) -> None:
    record.updated_at = now_iso()
    atomic_write_json(RunPaths(run_dir).record, record.to_json())


@contextlib.contextmanager
def update_run(run_dir: Path) -> Iterator[RunRecord]:
    """Lock the run record, yield it fresh from disk for changes, write it back atomically."""
    with file_lock(RunPaths(run_dir).lock):
        record = load_run(run_dir)
        yield record
        save_run(run_dir, record)


def run_umask(group_readable: bool) -> int:
    """What files made in a run may not allow: anything for others, and writing for the group."""
    return 0o027 if group_readable else 0o077


def make_private(run_dir: Path, group_readable: bool) -> None:
    """Create `run_dir` if needed and let only its owner (and with `group_readable` the owner's
    group, to read) in."""
    try:
        mode = 0o777 & ~run_umask(group_readable)
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, mode)
        paths = RunPaths(run_dir)
        for folder in (paths.trials, paths.markers, paths.submitit):
            folder.mkdir(mode=mode, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"{run_dir}: cannot make it a private run folder ({exc.strerror})",
            hint="pick a --run-dir you own, in a folder you can write",
        ) from None


def seal(folder: Path, group_readable: bool) -> None:
    """Take from everything under `folder` the permissions a run's files may not have (Harbor
    makes trial folders 0777). Files the user cannot change (a container's other users'
    files, before their owner is restored) are left to the run folder's own mode."""
    mask = run_umask(group_readable)
    for path in [folder, *folder.rglob("*")]:
        with contextlib.suppress(OSError):
            mode = path.lstat().st_mode
            if not stat.S_ISLNK(mode) and stat.S_IMODE(mode) & mask:
                os.chmod(path, stat.S_IMODE(mode) & ~mask)


def create_run(run_dir: Path, record: RunRecord) -> None:
    """Write the first record of a new run, in a private folder; refuses a folder that already
    holds a run."""
    with file_lock(RunPaths(run_dir).lock):
        if RunPaths(run_dir).record.exists():
            raise InputError(
                f"{run_dir}: already holds a run",
                hint="use `harbor-hpc resubmit` to continue it, or pick another --run-dir",
            )
        record.created_at = now_iso()
        save_run(run_dir, record)


TASK_HASHES_SCHEMA = "harbor-hpc/task-hashes/v1"


def read_task_hashes(run_dir: Path) -> dict[str, dict[str, str]]:
    """Each task's digest (tasks/digest.py) as the run recorded it; {} for a run made before
    runs recorded them, or a file that is not ours (then nothing is compared, and what is
    there now is recorded)."""
    path = RunPaths(run_dir).task_hashes
    if not path.exists():
        return {}
    data = read_json(path)
    if not isinstance(data, dict) or data.get("schema") != TASK_HASHES_SCHEMA:
        return {}
    tasks = data.get("tasks")
    if not isinstance(tasks, dict):
        return {}
    return {
        str(task): {str(k): str(v) for k, v in digest.items()}
        for task, digest in tasks.items()
        if isinstance(digest, dict)
    }


def record_task_hashes(run_dir: Path, digests: dict[str, dict[str, str]]) -> None:
    """Record `digests` over those of the same tasks, under the run's lock, atomically."""
    if not digests:
        return
    with file_lock(RunPaths(run_dir).lock):
        tasks = {**read_task_hashes(run_dir), **digests}
        data = {"schema": TASK_HASHES_SCHEMA, "tasks": tasks}
        # Compact: a run of 10,000 tasks holds 60,000 hashes.
        atomic_write_text(RunPaths(run_dir).task_hashes, json.dumps(data) + "\n")


def cancel_submissions(run_dir: Path) -> int:
    """Cancel every submission of the run made so far (a later resubmit is not): its workers
    see it within seconds, end their trials (Harbor records `CancelledError`) and start no
    more. Returns the number of the last cancelled submission."""
    with file_lock(RunPaths(run_dir).lock):
        through = len(load_run(run_dir).submissions)
        atomic_write_json(RunPaths(run_dir).cancel, {"through": through, "at": now_iso()})
    return through


def cancelled_through(run_dir: Path) -> int:
    """The number of the last cancelled submission of the run; 0 when none was."""
    try:
        return int(read_json(RunPaths(run_dir).cancel).get("through", 0))
    except (HarborHpcError, AttributeError, TypeError, ValueError):
        return 0  # none (or a foreign file): nothing cancelled


WAITING_FILE = "waiting-for.txt"


def say_waiting(trial_dir: Path, why: str | None) -> None:
    """Say in the trial's folder why it waits (None: it no longer does)."""
    path = trial_dir / WAITING_FILE
    with contextlib.suppress(OSError):  # a note, not the trial's work
        if why is None:
            path.unlink(missing_ok=True)
        else:
            atomic_write_text(path, why + "\n")


def waiting_for(trial_dir: Path) -> str | None:
    """Why a started trial waits, where it said so."""
    try:
        return (trial_dir / WAITING_FILE).read_text().strip() or None
    except OSError:
        return None


def new_trial_name(task: str, attempt: int) -> str:
    """A fresh trial folder name: the task's last path part, the attempt, a random suffix."""
    base = Path(task).name if task != "." else "task"
    return f"{base[:32].rstrip('_-')}__a{attempt}-{secrets.token_hex(3)}"


@dataclass(slots=True)
class Marker:
    """What a worker records when it starts a trial, and why it failed before Harbor could.

    `error_type`/`error_message` are set when the trial could not even be created (for example
    the environment refused the image), in which case Harbor writes no result.json.
    `terminated_by` is set when the job was told to stop while the trial ran.
    """

    trial: str
    task: str
    attempt: int
    submission: int
    job: str | None
    host: str
    pid: int
    started_at: str
    error_type: str | None = None
    error_message: str | None = None
    # What told the job to stop while this trial ran: a signal (scancel, shutdown), or
    # CANCELLED (the run's submissions cancelled from Python, `cancel_submissions`).
    terminated_by: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Marker:
        return cls(**{key: data.get(key) for key in cls.__dataclass_fields__})  # type: ignore[arg-type]


CANCELLED = "a cancel of the run"


def write_marker(run_dir: Path, marker: Marker) -> None:
    atomic_write_json(RunPaths(run_dir).marker(marker.trial), asdict(marker))


def read_marker(path: Path) -> Marker | None:
    """The marker in `path`; None when it is unreadable (a crash mid-write, a foreign file)."""
    try:
        return Marker.from_json(read_json(path))
    except (HarborHpcError, TypeError, AttributeError):
        return None
