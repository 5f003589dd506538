"""`setup-sh`: write `environment/files/setup.sh` into tasks, from `templates/setup.sh`.

Harbor's and NeMo Gym's Singularity flows stage `environment/files` at `/staging/env_files`
($HARBOR_STAGING) and run its setup.sh before the agent starts. The script makes sure the exec
server's uvicorn and fastapi import (installing them from staged wheels on offline compute nodes),
and with `replay_copy` repeats the Dockerfile's COPY/ADD of local files, so the task can run on a
shared base image without its own build.

Folders must be reachable inside the container, so wheels are staged into
`environment/files/wheels/` (hard links when on the same filesystem, else copies) and replayed
sources into `environment/files/_replay/` at their paths in the build context (only the files
Docker would send, `.dockerignore` honoured). An existing setup.sh is never replaced without
`force`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from harbor_hpc.core.errors import InputError
from harbor_hpc.core.files import atomic_write_text
from harbor_hpc.core.templates import read_template
from harbor_hpc.images.build import parse_build_args
from harbor_hpc.images.context import ContextError, context_files, match_source
from harbor_hpc.images.dockerfile import Copy, read_dockerfile
from harbor_hpc.tasks.discovery import Task, TaskProblem, discover_tasks

SETUP_SH = "setup.sh"
REPLAY_DIR = "_replay"
WHEELS_DIR = "wheels"
_PLACEHOLDER = "@@REPLAY_COPIES@@"
_SERVER_PACKAGES = ("uvicorn", "fastapi")


@dataclass
class SetupResult:
    dry_run: bool
    # Tasks given a setup.sh (or that would be, in a dry run).
    written: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    problems: list[TaskProblem] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "would_write" if self.dry_run else "written": self.written,
            "kept": self.kept,
            "problems": [problem.to_json() for problem in self.problems],
        }


@dataclass
class _Replay:
    """What a task's setup.sh replays and which context paths must be staged for it."""

    lines: list[str] = field(default_factory=list)
    staged: set[str] = field(default_factory=set)
    # What Docker would send of the context, minus what setup-sh itself wrote there.
    available: list[str] = field(default_factory=list)


class ReplayError(ValueError):
    """A COPY/ADD that cannot be repeated from staged files; the message names it."""


def check_wheels(folder: Path) -> list[Path]:
    """The wheels in `folder`, which must include the exec server's packages."""
    if not folder.is_dir():
        raise InputError(f"--wheels {folder}: not a folder")
    wheels = sorted(folder.glob("*.whl"))
    names = {wheel.name.split("-")[0].lower() for wheel in wheels}
    missing = [package for package in _SERVER_PACKAGES if package not in names]
    if missing:
        raise InputError(
            f"--wheels {folder}: no wheel for {', '.join(missing)}",
            hint="fill it with `pip download -d DIR --only-binary=:all: --python-version 3.X "
            "--platform manylinux2014_x86_64 uvicorn fastapi` (the containers' Python version)",
        )
    return wheels


@dataclass(frozen=True)
class SetupRequest:
    """One `setup-sh` over the tasks under `tasks_dir`."""

    tasks_dir: Path
    # Replace setup.sh files that exist.
    force: bool = False
    # Wheels of the exec server's packages to stage, for offline nodes.
    wheels_dir: Path | None = None
    # Repeat the Dockerfile's COPY/ADD of local files in setup.sh.
    replay_copy: bool = False
    # `NAME=VALUE`: those the images were built with; the replayed copies expand them.
    build_args: list[str] = field(default_factory=list)
    dry_run: bool = False
    # What harbor-hpc.toml may set (`core.config.configured`).
    CONFIGURED: ClassVar[tuple[str, ...]] = ("wheels_dir", "build_args")


def write_setup_scripts(request: SetupRequest) -> SetupResult:
    """Give every task under `request.tasks_dir` a setup.sh (and staged wheels / replay
    sources)."""
    root, wheels, force = request.tasks_dir, request.wheels_dir, request.force
    replay_copy, dry_run = request.replay_copy, request.dry_run
    build_args = parse_build_args(request.build_args)
    wheel_files = check_wheels(wheels) if wheels else []
    discovery = discover_tasks(root, require_dockerfile=replay_copy)
    result = SetupResult(dry_run, problems=list(discovery.problems))
    for task in discovery.tasks:
        files = task.environment_dir / "files"
        if (files / SETUP_SH).exists() and not force:
            result.kept.append(task.rel)
            continue
        try:
            replay = plan_replay(task, build_args) if replay_copy else _Replay()
        except (ReplayError, ContextError, OSError) as exc:
            result.problems.append(TaskProblem(task.dockerfile, f"cannot replay: {exc}"))
            continue
        result.written.append(task.rel)
        if dry_run:
            continue
        if wheel_files:
            _stage_wheels(wheel_files, files / WHEELS_DIR)
        if replay_copy:
            _stage_sources(task.environment_dir, replay, files / REPLAY_DIR)
        atomic_write_text(files / SETUP_SH, render_setup_sh(replay.lines), mode=0o755)
    return result


def render_setup_sh(replay_lines: list[str]) -> str:
    body = [f"{line} || return 1" for line in replay_lines] or [
        ":  # nothing to replay (written without --replay-copy, or no COPY/ADD of local files)"
    ]
    return read_template(SETUP_SH).replace(_PLACEHOLDER, "\n    ".join(body))


def plan_replay(task: Task, build_args: Mapping[str, str] | None = None) -> _Replay:
    """The replay commands for the task's final image and the context paths they need."""
    final = read_dockerfile(task.dockerfile.read_text(errors="replace"), build_args).final
    if final.problems:
        raise ReplayError("; ".join(final.problems))
    context = task.environment_dir
    own_outputs = (f"files/{REPLAY_DIR}", f"files/{WHEELS_DIR}", f"files/{SETUP_SH}")
    available = [rel for rel in context_files(context) if not rel.startswith(own_outputs)]
    replay = _Replay(available=available)
    for copy in final.copies:
        matches = [match for source in copy.sources for match in match_source(source, available)]
        into_dir = copy.dest_is_dir or len(matches) > 1
        for rel in matches:
            replay.lines.append(_replay_line(copy, context, rel, into_dir))
            replay.staged.add(rel)
    return replay


def _replay_line(copy: Copy, context: Path, rel: str, into_dir: bool) -> str:
    path = context / rel
    owner = [shlex.quote(copy.chown or ""), shlex.quote(copy.chmod or "")]
    if path.is_dir() and not path.is_symlink():
        return shlex.join(["replay_dir", rel, copy.dest]) + " " + " ".join(owner)
    if copy.extracts_archives and tarfile.is_tarfile(path):
        return shlex.join(["replay_extract", rel, copy.dest]) + " " + " ".join(owner)
    kind = "dir" if into_dir else "file"
    return shlex.join(["replay_file", rel, copy.dest, kind]) + " " + " ".join(owner)


def _stage_sources(context: Path, replay: _Replay, target: Path) -> None:
    """Copy the needed context paths (folders: what Docker sends of them) under `target`.

    Built in a temporary folder and swapped in, so a crash never leaves half a tree.
    """
    chosen = [
        rel
        for rel in replay.available
        if any(rel == n or n == "." or rel.startswith(n + "/") for n in replay.staged)
    ]
    scratch = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for rel in chosen:
        source, copy = context / rel, scratch / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir() and not source.is_symlink():
            copy.mkdir(exist_ok=True)
            shutil.copymode(source, copy)
        else:
            shutil.copy2(source, copy, follow_symlinks=False)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(scratch, target)


def _stage_wheels(wheels: list[Path], target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        staged = target / wheel.name
        if staged.exists() and staged.stat().st_size == wheel.stat().st_size:
            continue
        try:
            os.link(wheel, staged)
        except OSError:
            shutil.copy2(wheel, staged)
