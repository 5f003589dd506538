"""Find Harbor tasks under a root folder and read their task.toml as Harbor does.

A task is a folder holding `task.toml`; its identity is its path relative to the root (POSIX
form, `.` when the root itself is a task). The walk does not descend into a task (its build
context can be large) nor into hidden folders. Problems (a malformed task.toml, a missing
Dockerfile, a folder reached twice through a symlink) are collected by path and the walk goes on.
task.toml is read by Harbor's own `TaskConfig`, so what Harbor would refuse is a problem here too,
named in one line by its first error. Equal task.toml texts (a generated dataset's) are parsed and
validated once per walk and share one config, which no step changes.
"""

from __future__ import annotations

import os
import tomllib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harbor_hpc.core.errors import InputError
from harbor_hpc.core.files import read_bytes, read_in_threads, text_of

if TYPE_CHECKING:  # Harbor's models load when a task is read, not with every command
    from harbor.models.task.config import TaskConfig
    from pydantic import ValidationError

TASK_FILE = "task.toml"
DOCKERFILE = "Dockerfile"
# Compose files (services beside the task's own container), as Harbor's Docker environment
# looks for them.
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


def compose_file(environment_dir: Path) -> Path | None:
    """The task's own compose file, as Harbor's Docker environment finds it."""
    try:  # one listing, rather than a stat of each name (nearly every task has none)
        present = set(os.listdir(environment_dir))
    except OSError:  # no such folder, or one we may not list: ask for each name
        present = set(COMPOSE_FILES)
    for name in COMPOSE_FILES:
        if name in present and (environment_dir / name).is_file():
            return environment_dir / name
    return None


@dataclass(frozen=True)
class Task:
    root: Path
    path: Path
    rel: str
    # task.toml as Harbor reads it: its defaults and migrations (`memory = "2G"`, allow_internet)
    # applied, so every step sees the task Harbor will run.
    config: TaskConfig

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def dockerfile(self) -> Path:
        return self.environment_dir / DOCKERFILE

    @property
    def task_toml(self) -> Path:
        return self.path / TASK_FILE

    @property
    def docker_image(self) -> str | None:
        value: str | None = self.config.environment.docker_image
        return value

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def verifier_docker_image(self) -> str | None:
        """`[verifier.environment] docker_image`, None when the task sets none."""
        environment = self.config.verifier.environment
        value: str | None = environment.docker_image if environment else None
        return value

    @property
    def separate_verifier(self) -> bool:
        """Whether Harbor runs the verifier in a container of its own: `[verifier]
        environment_mode = "separate"`, or a `[verifier.environment]` table without an explicit
        mode. A tests/Dockerfile alone does not make it separate: in shared mode Harbor never
        reads it."""
        from harbor.models.task.config import VerifierEnvironmentMode
        from harbor.models.task.verifier_mode import resolve_task_verifier_mode

        mode = resolve_task_verifier_mode(self.config)
        return bool(mode == VerifierEnvironmentMode.SEPARATE)

    @property
    def verifier_build_dir(self) -> Path | None:
        """tests/, when the separate verifier's image is built from tests/Dockerfile."""
        if self.separate_verifier and (self.tests_dir / "Dockerfile").is_file():
            return self.tests_dir
        return None

    def compose_files(self) -> list[str]:
        """Compose files (relative to the task) whose sidecar services Harbor would start: in
        environment/, and in tests/ for a separate verifier."""
        folders = [self.environment_dir]
        if self.separate_verifier:
            folders.append(self.tests_dir)
        return [
            f"{folder.name}/{name}"
            for folder in folders
            for name in COMPOSE_FILES
            if (folder / name).is_file()
        ]

    @property
    def memory_mb(self) -> int | None:
        value: int | None = self.config.environment.memory_mb
        return value

    @property
    def cpus(self) -> int | None:
        value: int | None = self.config.environment.cpus
        return value

    @property
    def agent_timeout_sec(self) -> float | None:
        """None when task.toml sets none: the agent's own default applies."""
        value: float | None = self.config.agent.timeout_sec
        return value

    @property
    def verifier_timeout_sec(self) -> float:
        value: float = self.config.verifier.timeout_sec
        return value


@dataclass(frozen=True)
class TaskProblem:
    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"

    def to_json(self) -> dict[str, str]:
        return {"path": str(self.path), "message": self.message}


@dataclass
class Discovery:
    root: Path
    tasks: list[Task] = field(default_factory=list)
    problems: list[TaskProblem] = field(default_factory=list)

    def by_rel(self) -> dict[str, Task]:
        return {task.rel: task for task in self.tasks}


def discover_tasks(
    root: Path, *, require_dockerfile: bool = True, found: Callable[[Task], object] | None = None
) -> Discovery:
    """Every task under `root`, sorted by relative path, plus the problems met on the way. A
    `root` that is itself a task is that one task, named by its folder as in its parent.
    `found` is called with each task as soon as it is loaded (in the order of the walk), so
    that work on it can begin while the walk goes on."""
    root = root.expanduser().absolute()
    if not root.is_dir():
        raise InputError(f"{root}: not a folder", hint="pass the folder that holds your tasks")
    if (root / TASK_FILE).is_file() and root.parent != root:
        one = Discovery(root.parent)
        task_or_problem = load_task(root.parent, root, require_dockerfile=require_dockerfile)
        if isinstance(task_or_problem, Task):
            one.tasks.append(task_or_problem)
            if found is not None:
                found(task_or_problem)
        else:
            one.problems.append(task_or_problem)
        return one
    discovery = Discovery(root)
    configs: dict[str, TaskConfig | str] = {}
    top = str(root)
    prefix = top if top.endswith(os.sep) else top + os.sep
    real_top = os.path.realpath(top)
    seen: dict[str, Path] = {real_top: root}
    # The walk, folders before their subfolders, each folder's in sorted order, as os.walk
    # walks; only a folder that is a task (it holds task.toml, which is then read) is never
    # listed: one read where os.walk lists it and stats what it holds.
    # Each folder's task.toml is read several at a time (a shared filesystem's round trips),
    # ahead of the walk.
    walk = [read_in_threads(_with_task_toml, _subfolders(top, real_top))]
    while walk:
        folder = next(walk[-1], None)
        if folder is None:
            walk.pop()
            continue
        path, real, data = folder
        if real in seen:
            if data is not None:
                discovery.problems.append(
                    TaskProblem(Path(path), f"duplicate of {seen[real]} (symlink)")
                )
            continue
        here = seen[real] = Path(path)
        if data is None:
            walk.append(read_in_threads(_with_task_toml, _subfolders(path, real)))
            continue
        rel = path[len(prefix) :]
        task_or_problem = _load(
            root, here, rel, configs, require_dockerfile=require_dockerfile, data=data
        )
        if isinstance(task_or_problem, Task):
            discovery.tasks.append(task_or_problem)
            if found is not None:
                found(task_or_problem)
        else:
            discovery.problems.append(task_or_problem)
    discovery.tasks.sort(key=lambda task: task.rel)
    return discovery


def _subfolders(folder: str, real: str) -> Iterator[tuple[str, str]]:
    """The folders in `folder` (links to folders too; hidden ones left out), sorted, each with
    its real path: that of `folder` and its name, unless it is a link (resolving every path
    anew would walk every part of it). A folder that cannot be listed has none, as in os.walk."""
    try:
        with os.scandir(folder) as listing:
            entries = sorted(
                (entry for entry in listing if entry.name[0] != "." and _is_folder(entry)),
                key=lambda entry: entry.name,
            )
    except OSError:
        return
    for entry in entries:
        if entry.is_symlink():
            yield entry.path, os.path.realpath(entry.path)
        else:
            yield entry.path, os.path.join(real, entry.name)


def _is_folder(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _with_task_toml(folder: tuple[str, str]) -> tuple[str, str, bytes | OSError | None]:
    return (*folder, _task_toml(folder[0]))


def _task_toml(folder: str) -> bytes | OSError | None:
    """`folder`'s task.toml, the error reading it, or None where it has none (a folder of that
    name is none either)."""
    path = os.path.join(folder, TASK_FILE)
    try:
        return read_bytes(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
        # A link to nowhere is a task.toml that cannot be read.
        return exc if os.path.islink(path) else None
    except PermissionError as exc:
        # Unreadable, or the folder may not be searched: a task if task.toml is listed there.
        try:
            return exc if TASK_FILE in os.listdir(folder) else None
        except OSError:
            return None
    except OSError as exc:
        return exc


def load_task(root: Path, path: Path, *, require_dockerfile: bool = True) -> Task | TaskProblem:
    rel = path.relative_to(root).as_posix() if path != root else "."
    return _load(root, path, rel, {}, require_dockerfile=require_dockerfile)


def _load(
    root: Path,
    path: Path,
    rel: str,
    configs: dict[str, TaskConfig | str],
    *,
    require_dockerfile: bool,
    data: bytes | OSError | None = None,
) -> Task | TaskProblem:
    """The task at `path` (`data`: its task.toml read already, or the error reading it);
    `configs` holds what each task.toml text read so far became (its config, or why Harbor
    refuses it), so equal files are parsed and validated once."""
    toml_path = path / TASK_FILE
    try:
        if data is None:
            data = read_bytes(toml_path)
        elif isinstance(data, OSError):
            raise data
        text = text_of(data)
    except UnicodeDecodeError as exc:
        return TaskProblem(toml_path, f"not valid TOML ({exc})")
    except OSError as exc:
        return TaskProblem(toml_path, f"cannot read ({exc.strerror})")
    config = configs.get(text)
    if config is None:
        config = configs[text] = _config(text)
    if isinstance(config, str):
        return TaskProblem(toml_path, config)
    task = Task(root=root, path=path, rel=rel, config=config)
    if require_dockerfile and not os.path.isfile(os.path.join(path, "environment", DOCKERFILE)):
        return TaskProblem(path, "no environment/Dockerfile")
    return task


def _config(text: str) -> TaskConfig | str:
    """task.toml's text as Harbor's `TaskConfig`, or why Harbor would refuse it."""
    from harbor.models.task.config import TaskConfig
    from pydantic import ValidationError

    try:
        data = tomllib.loads(text)
        with warnings.catch_warnings(action="ignore", category=DeprecationWarning):
            return TaskConfig.model_validate(data)  # Harbor warns of what it migrates
    except tomllib.TOMLDecodeError as exc:
        return f"not valid TOML ({exc})"
    except ValidationError as exc:
        return _first_error(exc)


def _first_error(exc: ValidationError) -> str:
    """Pydantic's first complaint in one line: where in task.toml, and what."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    message = " ".join(error["msg"].split())
    more = exc.error_count() - 1
    text = f"{where}: {message}" if where else message
    return text + (f" (and {more} more)" if more else "")
