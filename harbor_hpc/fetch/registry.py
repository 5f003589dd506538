"""`harbor-hpc fetch NAME@VERSION`: a dataset of Harbor's registry, downloaded by Harbor itself.

Harbor resolves the name as `harbor run -d` does (`DatasetConfig.get_task_configs`): NAME[@VERSION]
in a registry.json (a path or URL: `registry`), in a git registry (`repo`, its registry.json
lists the datasets) or in Harbor's default registry; ORG/NAME[@REF] on Harbor's hub. `include`
globs pick tasks by name, as `harbor run --include-task-name` does. Harbor's
`TaskClient.download_tasks` then downloads them in its export layout, one folder per task named
as the task (a sparse git checkout per repository, or the hub's package archives), into a
staging folder in DEST. Only once every task has arrived is each renamed to DEST/<task>
(`place.Destination.install`): a failure leaves DEST as it was. A rerun leaves a task whose
content (Harbor's content hash, `Packager.compute_content_hash`) is unchanged as it is, edits
such as `rewrite`'s kept, and replaces one that changed; a folder that no fetch of that task
placed is never replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_hpc.core.batch import Step, done, failed
from harbor_hpc.core.errors import HarborHpcError, InputError, from_os_error
from harbor_hpc.fetch.place import ArchiveRecord, Destination, Failure, Staging, load_state
from harbor_hpc.tasks.discovery import discover_tasks

if TYPE_CHECKING:  # Harbor loads when a fetch runs, not with every command
    from harbor.models.job.config import DatasetConfig
    from harbor.tasks.client import TaskIdType

# Called as tasks arrive: (tasks downloaded, tasks in all, the task's name).
TaskProgress = Callable[[int, int, str], None]

_LIST_HINT = (
    "check the name, @version and --include: `harbor datasets list` lists the datasets of "
    "Harbor's default registry and hub, which need internet"
)


def _list_hint(registry: str | None, repo: str | None) -> str:
    """What to check when a name is not found or a registry is refused, for where it was."""
    if registry is None and repo is None:
        return _LIST_HINT
    listing = f"--repo {repo}" if repo is not None else f"--registry-path {registry}"
    return (
        f"check the name, @version and --include, and the registry's JSON: `harbor datasets "
        f"list {listing}` lists its datasets (docs/fetch.md shows a registry.json)"
    )


_OFFLINE_HINT = (
    "fetch where the source can be reached (a login node with internet) into the shared "
    "filesystem, then build, convert and rewrite as usual"
)


@dataclass(frozen=True)
class _Task:
    """One task of the dataset: its folder name in DEST, and where Harbor takes it from."""

    name: str
    id: TaskIdType

    def source(self, commit: str | None = None) -> str:
        from harbor.models.task.id import GitTaskId, PackageTaskId

        if isinstance(self.id, GitTaskId):
            at = commit or self.id.git_commit_id or "HEAD"
            return f"{self.id.path.as_posix()} in {self.id.git_url} at {at}"
        if isinstance(self.id, PackageTaskId):
            return f"{self.id.org}/{self.id.name}@{self.id.ref}"
        return str(self.id.path)


@dataclass
class RegistryReport:
    dataset: str
    dest: Path
    placed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    # Task name -> where it came from (a git task: its path, repository and commit).
    sources: dict[str, str] = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)
    task_problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "dest": str(self.dest),
            "placed": self.placed,
            "unchanged": self.unchanged,
            "refused": [failure.to_json() for failure in self.failed],
            "sources": self.sources,
            "tasks": self.tasks,
            "task_problems": self.task_problems,
        }


@dataclass(frozen=True)
class PlannedTask:
    """What fetch would do with one task (done: the action), or why it would not (failed)."""

    name: str
    source: str
    step: Step[str]

    @property
    def action(self) -> str:
        return self.step.value if self.step.value is not None else f"refuse: {self.step.reason}"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "state": self.step.state,
            "action": self.action,
        }


@dataclass
class RegistryPlan:
    dataset: str
    dest: Path
    tasks: list[PlannedTask]

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "dest": str(self.dest),
            "dry_run": True,
            "tasks": [task.to_json() for task in self.tasks],
        }


def fetch_registry_dataset(
    name: str,
    dest: Path,
    *,
    registry: str | None = None,
    repo: str | None = None,
    include: Sequence[str] = (),
    on_task: TaskProgress | None = None,
) -> RegistryReport:
    """Download the tasks of Harbor dataset `name` into `dest`; see the module docstring.

    `registry` is a registry.json (a path, or an http(s) URL; with `repo`, its path inside that
    repository), `repo` a git registry as Harbor's `--repo` takes it.
    """
    tasks = _resolve(name, registry, repo, include)
    report = RegistryReport(dataset=name, dest=dest.expanduser().absolute())
    with Destination.open(report.dest) as destination, destination.staging() as staging:
        digests = _download(name, tasks, staging, on_task, report.sources)
        for task in tasks:
            if destination.is_unchanged(task.name, digests[task.name]):
                report.unchanged.append(task.name)
                continue
            try:
                destination.install(task.name, staging, [task.name], digests[task.name])
            except HarborHpcError as exc:
                report.failed.append(Failure(task.name, exc.message, exc.hint))
            except OSError as exc:
                report.failed.append(Failure(task.name, f"{task.name}: {exc}"))
            else:
                report.placed.append(task.name)
    found = discover_tasks(report.dest, require_dockerfile=False)
    report.tasks = [task.rel for task in found.tasks]
    report.task_problems = [str(problem) for problem in found.problems]
    return report


def plan_registry_dataset(
    name: str,
    dest: Path,
    *,
    registry: str | None = None,
    repo: str | None = None,
    include: Sequence[str] = (),
) -> RegistryPlan:
    """The tasks `fetch_registry_dataset` would download, and where: Harbor resolves the name,
    nothing is downloaded or written."""
    tasks = _resolve(name, registry, repo, include)
    dest = dest.expanduser().absolute()
    state = load_state(dest)
    planned = [PlannedTask(task.name, task.source(), _planned(dest, state, task)) for task in tasks]
    return RegistryPlan(name, dest, planned)


def _planned(dest: Path, state: dict[str, ArchiveRecord], task: _Task) -> Step[str]:
    if task.name in state:
        return done(f"download, and replace {task.name}/ if it changed")
    if os.path.lexists(dest / task.name):
        return failed(f"{dest / task.name} is there, and no fetch of {task.name} placed it")
    return done(f"download into {task.name}/")


def _resolve(
    name: str, registry: str | None, repo: str | None, include: Sequence[str]
) -> list[_Task]:
    """The dataset's tasks, picked by `include`, as Harbor resolves them."""
    from harbor.models.task.id import PackageTaskId

    with _harbor_errors(name, resolving=True, hint=_list_hint(registry, repo)):
        configs = asyncio.run(_config(name, registry, repo, include).get_task_configs())
    tasks = []
    for config in configs:
        task_id = config.get_task_id()
        # Harbor's export layout: a package task's folder is its name without the org.
        folder = task_id.name if isinstance(task_id, PackageTaskId) else task_id.get_name()
        tasks.append(_Task(folder, task_id))
    twice = sorted(folder for folder, count in Counter(t.name for t in tasks).items() if count > 1)
    if twice:
        raise HarborHpcError(
            f"{name}: more than one task is named {', '.join(twice)}, and each task gets the "
            "folder of its name",
            hint="fetch them into separate --dest folders, picking each with --include",
        )
    return tasks


def _config(
    name: str, registry: str | None, repo: str | None, include: Sequence[str]
) -> DatasetConfig:
    """Harbor's dataset config for `name`, as `harbor run -d NAME --registry-path/--repo` makes
    it."""
    from harbor.models.job.config import DatasetConfig

    bare, _, version = name.partition("@")
    task_names = list(include) or None
    where: dict[str, Any] = {}
    if registry is not None and "://" in registry:
        where["registry_url"] = registry
    elif registry is not None and repo is not None:
        where["registry_path"] = Path(registry)  # a path inside the git registry
    elif registry is not None:
        path = Path(registry).expanduser().absolute()
        if not path.is_file():
            raise InputError(
                f"--registry {registry}: no such file",
                hint="give a registry.json, as a path or an http(s) URL",
            )
        where["registry_path"] = path
    with _harbor_errors(name, resolving=True):
        if repo is not None:
            return DatasetConfig(
                repo=repo, name=bare, version=version or None, task_names=task_names, **where
            )
        if "/" in bare:
            if where:
                raise InputError(
                    f"{name}: ORG/NAME is a package on Harbor's hub, which --registry does not "
                    "apply to",
                    hint="name a registry.json's dataset as NAME@VERSION, without ORG/",
                )
            return DatasetConfig(name=bare, ref=version or "latest", task_names=task_names)
        return DatasetConfig(name=bare, version=version or None, task_names=task_names, **where)


def _download(
    name: str,
    tasks: list[_Task],
    staging: Staging,
    on_task: TaskProgress | None,
    sources: dict[str, str],
) -> dict[str, str]:
    """Have Harbor download `tasks` into `staging.new`, one folder each; return each task's
    content hash and fill in `sources`. Raises, with the tasks only in `staging`, if any fails."""
    from harbor.publisher.packager import Packager
    from harbor.tasks.client import TaskClient, TaskDownloadResult

    arrived = 0

    def on_complete(_task_id: TaskIdType, result: TaskDownloadResult) -> None:
        nonlocal arrived
        arrived += 1
        if on_task is not None:
            on_task(arrived, len(tasks), result.path.name)

    digests = {}
    with _harbor_errors(name, resolving=False):
        batch = asyncio.run(
            TaskClient().download_tasks(
                [task.id for task in tasks],
                output_dir=staging.new,
                export=True,
                on_task_download_complete=on_complete,
            )
        )
        for task, result in zip(tasks, batch.results, strict=True):
            staged = staging.new / task.name
            if result.path != staged:  # a local task: Harbor leaves it where it is
                shutil.copytree(result.path, staged, symlinks=True)
            sources[task.name] = task.source(result.resolved_git_commit_id)
            digests[task.name] = Packager.compute_content_hash(staged)[0]
    return digests


@contextlib.contextmanager
def _harbor_errors(name: str, *, resolving: bool, hint: str = _LIST_HINT) -> Iterator[None]:
    """Harbor's failures, each as one line naming `name`, `hint` for a name or registry
    refused; anything else is a bug and passes."""
    try:
        yield
    except HarborHpcError:
        raise
    except Exception as exc:
        error = _user_error(name, exc, resolving=resolving, hint=hint)
        if error is None:
            raise
        raise error from None


def _user_error(
    name: str, exc: BaseException, *, resolving: bool, hint: str = _LIST_HINT
) -> HarborHpcError | None:
    import httpx
    from harbor.registry.client.base import EmptyDatasetError, UnavailableDatasetTasksError
    from pydantic import ValidationError

    if isinstance(exc, BaseExceptionGroup):  # concurrent package downloads: the first says why
        return _user_error(name, exc.exceptions[0], resolving=resolving, hint=hint)
    if isinstance(exc, subprocess.CalledProcessError):
        # git's first `fatal:` line says why; what follows it is advice.
        said = [line for line in (exc.stderr or b"").decode(errors="replace").splitlines() if line]
        why = next((line for line in said if line.startswith("fatal:")), None) or (
            said[-1] if said else f"exit status {exc.returncode}"
        )
        return HarborHpcError(
            f"{name}: `{' '.join(map(str, exc.cmd))}` failed: {why}",
            hint="check that the repository can be reached from here and holds that commit; "
            + _OFFLINE_HINT,
        )
    if isinstance(exc, ValidationError):  # Harbor's config or registry.json refused
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return InputError(f"{name}: {where + ': ' if where else ''}{first['msg']}", hint=hint)
    if isinstance(exc, ValueError | KeyError) and resolving:
        refused = _first_line(exc)
        if "--path" in refused:  # Harbor's advice for its own CLI: a local folder as --repo
            refused = "--repo takes a git URL (https, ssh, git)"
            hint = "a registry on this machine is a registry.json: give it with --registry FILE"
        return InputError(f"{name}: {refused}", hint=hint)
    if isinstance(exc, ValueError | EmptyDatasetError | UnavailableDatasetTasksError):
        return HarborHpcError(f"{name}: {_first_line(exc)}")
    if isinstance(exc, httpx.HTTPError):
        return HarborHpcError(f"{name}: Harbor's hub cannot be reached ({exc})", hint=_OFFLINE_HINT)
    if isinstance(exc, OSError):  # a registry URL that cannot be read, a full disk
        return from_os_error(exc) or HarborHpcError(f"{name}: {exc}", hint=_OFFLINE_HINT)
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
