"""`harbor-hpc fetch`: a Hugging Face task dataset, only the part asked for, as task folders.

`fetch` downloads the repository files matching the include patterns into the Hugging Face cache
(`hub`), unpacks every archive into DEST at the archive's own folder and copies the other files to
their repository paths (`place`, refusing unsafe archives whole: `unpack`), then lists the tasks
found under DEST. A refused archive does not stop the others; the report lists it and the caller
decides the exit code. A dataset of Harbor's registry (NAME@VERSION) is downloaded by Harbor's own
client into the same kind of DEST, one folder per task: `registry`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harbor_hpc.core.batch import State, Step, done, failed, skipped
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.fetch.hub import Hub, PlannedFile, download, plan
from harbor_hpc.fetch.place import Destination, Failure, archive_folder, load_state, sha256_of
from harbor_hpc.fetch.registry import (
    RegistryPlan,
    RegistryReport,
    fetch_registry_dataset,
    plan_registry_dataset,
)
from harbor_hpc.fetch.unpack import UnsafeArchiveError, check, is_archive
from harbor_hpc.tasks.discovery import discover_tasks

log = logging.getLogger(__name__)

__all__ = [
    "FetchPlan",
    "FetchReport",
    "Hub",
    "RegistryPlan",
    "RegistryReport",
    "fetch",
    "fetch_registry_dataset",
    "plan_fetch",
    "plan_registry_dataset",
]

# Called before each archive is looked at: (archives done, archives in all, repository path).
ArchiveProgress = Callable[[int, int, str], None]


@dataclass
class FetchReport:
    repo_id: str
    commit: str
    dest: Path
    files_placed: list[str] = field(default_factory=list)
    files_unchanged: list[str] = field(default_factory=list)
    unpacked: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)
    task_problems: list[str] = field(default_factory=list)

    def tasks_by_folder(self) -> dict[str, int]:
        """Task count per top folder of DEST (`.` for a task at DEST itself)."""
        return dict(sorted(Counter(rel.split("/", 1)[0] for rel in self.tasks).items()))

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "commit": self.commit,
            "dest": str(self.dest),
            "files": {"placed": self.files_placed, "unchanged": self.files_unchanged},
            "archives": {
                "unpacked": self.unpacked,
                "unchanged": self.unchanged,
                "refused": [failure.to_json() for failure in self.failed],
            },
            "tasks_by_folder": self.tasks_by_folder(),
            "tasks": self.tasks,
            "task_problems": self.task_problems,
        }


def fetch(
    repo_id: str,
    dest: Path,
    *,
    include: Sequence[str] = (),
    revision: str | None = None,
    hub: Hub | None = None,
    on_archive: ArchiveProgress | None = None,
) -> FetchReport:
    """Bring the matching files of dataset `repo_id` into `dest`; see the module docstring."""
    snapshot = download(repo_id, include=include, revision=revision, hub=hub)
    report = FetchReport(repo_id=repo_id, commit=snapshot.commit, dest=dest.expanduser().absolute())
    archives = [path for path in snapshot.files if is_archive(path)]
    with Destination.open(report.dest) as destination:
        for path in snapshot.files:
            if is_archive(path):
                continue
            try:
                copied = destination.place_file(path, snapshot.local(path))
            except (HarborHpcError, OSError) as exc:
                report.failed.append(_failure(path, exc))
                continue
            (report.files_placed if copied else report.files_unchanged).append(path)
        for done, path in enumerate(archives):
            if on_archive is not None:
                on_archive(done, len(archives), path)
            source = snapshot.local(path)
            sha256 = sha256_of(source)
            if destination.is_unchanged(path, sha256):
                log.info("%s: unchanged since it was unpacked", path)
                report.unchanged.append(path)
                continue
            try:
                roots = destination.unpack_archive(path, source, sha256)
            except (HarborHpcError, OSError) as exc:
                report.failed.append(_failure(path, exc))
            else:
                log.info("%s: unpacked %s", path, ", ".join(roots) or "nothing (empty archive)")
                report.unpacked.append(path)
        if on_archive is not None and archives:
            on_archive(len(archives), len(archives), "")
    found = discover_tasks(report.dest, require_dockerfile=False)
    report.tasks = [task.rel for task in found.tasks]
    report.task_problems = [str(problem) for problem in found.problems]
    return report


def _failure(path: str, exc: HarborHpcError | OSError) -> Failure:
    if isinstance(exc, UnsafeArchiveError):
        return Failure(path, exc.message, exc.hint, exc.member)
    if isinstance(exc, HarborHpcError):
        return Failure(path, exc.message, exc.hint)
    return Failure(path, f"{path}: {exc}")


@dataclass(frozen=True)
class PlannedStep:
    """What fetch would do with one repository file (done: the action), or why it would not
    (skipped: nothing changed; failed: the archive would be refused)."""

    path: str
    step: Step[str]
    size: int | None
    cached: bool

    @property
    def action(self) -> str:
        """One line: the action, `skip: WHY` or `refuse: WHY`."""
        if self.step.value is not None:
            return self.step.value
        return f"{_VERB[self.step.state]}: {self.step.reason}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "state": self.step.state,
            "action": self.action,
            "size": self.size,
            "cached": self.cached,
        }


_VERB = {State.SKIPPED: "skip", State.FAILED: "refuse"}


@dataclass
class FetchPlan:
    repo_id: str
    dest: Path
    steps: list[PlannedStep]

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "dest": str(self.dest),
            "dry_run": True,
            "steps": [step.to_json() for step in self.steps],
        }


def plan_fetch(
    repo_id: str,
    dest: Path,
    *,
    include: Sequence[str] = (),
    revision: str | None = None,
    hub: Hub | None = None,
) -> FetchPlan:
    """What `fetch` would download, unpack and copy, without writing to DEST."""
    dest = dest.expanduser().absolute()
    destination = Destination(dest, load_state(dest))
    files = plan(repo_id, include=include, revision=revision, hub=hub)
    steps = [PlannedStep(f.path, _planned(destination, f), f.size, f.cached) for f in files]
    return FetchPlan(repo_id, dest, steps)


def _planned(destination: Destination, planned: PlannedFile) -> Step[str]:
    target = archive_folder(planned.path) or "."
    if not is_archive(planned.path):
        if planned.cached and destination.has_copy(planned.path, planned.local):
            return skipped("already copied, unchanged")
        return done(f"copy to {planned.path}")
    if not planned.cached:
        return done(f"download and unpack into {target}/")
    if destination.is_unchanged(planned.path, sha256_of(planned.local)):
        return skipped("already unpacked, unchanged")
    try:
        check(planned.local, label=planned.path)
    except HarborHpcError as exc:
        return failed(exc.message)
    return done(f"unpack into {target}/")
