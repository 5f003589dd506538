"""`rewrite`: point each task's `[environment].docker_image` at its pinned image (or its .sif),
a separate verifier's `[verifier.environment].docker_image` at its own, and each compose
service's `image:` in the task's compose file at its own (`set_service_image`).

Only that value changes: every other byte of task.toml (comments, order, spacing) stays. A
plain `docker_image = "..."` line (nearly every task) is edited in place as text; anything else
(no such line yet, dotted keys, unusual quoting) goes through tomlkit, which keeps the document's
formatting. Either way the result is parsed back and must equal the original with just that value
changed, so a surprise in a file can never write a wrong task.toml. Line endings are the file's
own (CRLF stays CRLF, lines added end like the rest) and a file without a final newline stays so.
Files are replaced atomically and a task already pointing at the right image is not written at
all. A symlinked task.toml is edited in its target (the link stays a link), and a task.toml the
user made read-only is left alone and named: the atomic rename would otherwise go through it.

A task in separate verifier mode without a `[verifier.environment]` table gets one: Harbor then
gives its verifier a copy of `[environment]` (resources, network, env), so the new table starts as
that copy (its docker_image aside), and the verifier keeps the same settings with its image named.

In a compose file only the service's `image:` line changes (added under the service's name where
it has none: a `build:` beside it stays, as Docker Compose then names what it builds); the file
read back must equal the original with just that value changed, or the task is named instead.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit
import tomlkit.exceptions
import yaml

from harbor_hpc.core.batch import Step, done, map_in_threads, skipped
from harbor_hpc.core.errors import InputError
from harbor_hpc.core.files import Replacements, read_small
from harbor_hpc.tasks.discovery import Task, TaskProblem, compose_file, discover_tasks
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, load_manifest

ENVIRONMENT = ("environment",)
VERIFIER_ENVIRONMENT = ("verifier", "environment")
_ANY_HEADER = re.compile(r"^[ \t]*\[", re.M)
_DOCKER_IMAGE_LINE = re.compile(
    r"^([ \t]*docker_image[ \t]*=[ \t]*)(\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*')", re.M
)


@dataclass
class RewriteResult:
    dry_run: bool
    # Tasks changed (or that would be, in a dry run).
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    # Task -> why it was left alone (image failed, not built, no .sif yet).
    skipped: dict[str, str] = field(default_factory=dict)
    problems: list[TaskProblem] = field(default_factory=list)
    # Task -> the unified diff of its change, in a dry run.
    diffs: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.problems

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "changed": self.changed,
            "unchanged": self.unchanged,
            "skipped": self.skipped,
            "problems": [problem.to_json() for problem in self.problems],
        }
        if self.dry_run:
            data["diffs"] = self.diffs
        return data


def rewrite_tasks(
    root: Path,
    manifest_path: Path,
    *,
    sif: bool = False,
    dry_run: bool = False,
    jobs: int = 4,
) -> RewriteResult:
    """Set docker_image in every task under `root` that the manifest has an image (or .sif) for."""
    manifest = load_manifest(manifest_path)
    discovery = discover_tasks(root, require_dockerfile=False)
    if discovery.tasks and not any(task.rel in manifest.tasks for task in discovery.tasks):
        raise InputError(
            f"none of the {len(discovery.tasks)} tasks under {discovery.root} is in "
            f"{manifest_path} (built from {manifest.tasks_root})",
            hint="pass the tasks folder that was built (task names are paths relative to it)",
        )
    result = RewriteResult(dry_run, problems=list(discovery.problems))
    edits: list[tuple[Task, str, str | None, dict[str, str]]] = []
    for task in discovery.tasks:
        target = _target(manifest, task.rel, sif=sif)
        verifier = _verifier_target(manifest, task.rel, sif=sif)
        verifier_image = verifier.value if verifier else None
        services = _service_targets(manifest, task.rel, sif=sif)
        if target.value is None:
            result.skipped[task.rel] = target.reason
        elif verifier is not None and verifier_image is None:
            result.skipped[task.rel] = "verifier image: " + verifier.reason
        elif services.value is None:
            result.skipped[task.rel] = services.reason
        elif (
            task.docker_image == target.value
            and verifier_image in (None, task.verifier_docker_image)
            and not services.value
        ):
            result.unchanged.append(task.rel)
        else:
            edits.append((task, target.value, verifier_image, services.value))

    # (task.toml, image, verifier image) -> the edited task.toml: equal files are edited once.
    edited: dict[tuple[str, str, str | None], str] = {}

    def edit(item: tuple[Task, str, str | None, dict[str, str]]) -> _Edit | TaskProblem:
        task, target, verifier, services = item
        where = task.task_toml
        try:
            # A symlink's target is what changes: the link stays, pointing at the edited file.
            path = where.resolve(strict=True) if where.is_symlink() else where
            data, status = read_small(str(path))
            old = data.decode()  # bytes as they are: no newline translation
            if verifier == task.verifier_docker_image:
                verifier = None
            new = edited.get((old, target, verifier))
            if new is None:
                new = set_docker_image(old, target)
                if verifier is not None:
                    new = set_docker_image(new, verifier, table=VERIFIER_ENVIRONMENT)
                edited[(old, target, verifier)] = new
            files = [(path, old, new, status)]
            compose = compose_file(task.environment_dir) if services else None
            if compose is not None:
                where = compose
                path = compose.resolve(strict=True)
                data, status = read_small(str(path))
                old = new = data.decode()
                for service, image in sorted(services.items()):
                    new = set_service_image(new, service, image)
                files.append((path, old, new, status))
            changed = [(p, a, b, _writable_mode(p, s)) for p, a, b, s in files if a != b]
            return _Edit(
                task,
                [(p, a, b, mode) for p, a, b, mode in changed if mode is not None],
                [p for p, _, _, mode in changed if mode is None],
            )
        except (OSError, ValueError) as exc:
            return TaskProblem(where, f"not rewritten: {exc}")

    changes: list[_Edit] = []
    for outcome in map_in_threads(edit, edits, jobs):
        if isinstance(outcome, TaskProblem):
            result.problems.append(outcome)
        elif outcome.locked:
            result.skipped[outcome.task.rel] = (
                f"{outcome.locked[0]}: read-only: chmod u+w it to let rewrite change it"
            )
        elif not outcome.files:
            result.unchanged.append(outcome.task.rel)
        else:
            changes.append(outcome)
    problems = {} if dry_run else _write(changes, jobs)
    for change in changes:
        if (error := problems.get(change.task.rel)) is not None:
            where = Path(error.filename) if error.filename else change.task.task_toml
            result.problems.append(TaskProblem(where, f"not written: {error.strerror or error}"))
            continue
        result.changed.append(change.task.rel)
        if dry_run:
            result.diffs[change.task.rel] = "".join(
                unified_diff(change.task, path, old, new) for path, old, new, _ in change.files
            )
    result.unchanged.sort()
    return result


def _write(changes: list[_Edit], jobs: int) -> dict[str, OSError]:
    """Write every change (each task's files all or none); the tasks whose files could not be
    written (the folder not writable, a full disk: those tasks only), with why."""

    def stage(change: _Edit) -> tuple[str, OSError] | None:
        try:
            batch.stage(
                change.task.rel, [(p, new.encode(), mode) for p, _, new, mode in change.files]
            )
        except OSError as exc:
            return change.task.rel, exc
        return None

    with Replacements[str]() as batch:
        unstaged = dict(f for f in map_in_threads(stage, changes, jobs) if f is not None)
        return {**unstaged, **batch.commit()}


@dataclass(frozen=True)
class _Edit:
    task: Task
    # (where the new text goes: task.toml or the compose file, or the file it links to; the
    # old text; the new; its permissions, which the new file keeps), for each file that changes.
    files: list[tuple[Path, str, str, int]]
    # The files that would change but that the user made read-only (left alone, named).
    locked: list[Path]


def _writable_mode(path: Path, status: os.stat_result) -> int | None:
    """`path`'s permissions (`status`, its target's if a link), or None where the user took write
    permission away from it: its owner's write bit is off, or we may not write it. A rename over
    it would succeed all the same."""
    if not status.st_mode & stat.S_IWUSR or (
        status.st_uid != os.geteuid() and not os.access(path, os.W_OK)
    ):
        return None
    return status.st_mode & 0o7777


_NO_IMAGE = "the manifest names no image for it"
_NO_SIF = "no .sif yet (run `harbor-hpc convert`)"


def _target(manifest: Manifest, task: str, *, sif: bool) -> Step[str]:
    """The docker_image value for `task`, or why it is skipped."""
    record = manifest.tasks.get(task)
    if record is None:
        return skipped("not in the manifest (run `harbor-hpc build` on these tasks)")
    if record.error:
        return skipped(record.error)
    return _image_target(manifest.image_of(task), sif=sif)


def _verifier_target(manifest: Manifest, task: str, *, sif: bool) -> Step[str] | None:
    """The `[verifier.environment]` docker_image for `task`, why it is skipped, or None when
    its verifier has no image of its own."""
    record = manifest.tasks.get(task)
    verifier = record.verifier if record else None
    if verifier is None:
        return None
    if verifier.error:
        return skipped(verifier.error)
    if verifier.context is not None:
        return _image_target(manifest.verifier_image_of(task), sif=sif)
    if verifier.image is None:
        return skipped(_NO_IMAGE)
    if sif:  # the author's reference
        return done(verifier.sif) if verifier.sif else skipped(_NO_SIF)
    return done(verifier.image)


def _service_targets(manifest: Manifest, task: str, *, sif: bool) -> Step[dict[str, str]]:
    """The `image:` for each of the task's compose services the manifest records, or why the
    task is skipped."""
    record = manifest.tasks.get(task)
    targets: dict[str, str] = {}
    for service, role in sorted((record.services if record else {}).items()):
        target: Step[str]
        if role.error:
            target = skipped(role.error)
        elif role.context is not None:
            target = _image_target(manifest.images.get(role.context), sif=sif)
        elif role.image is None:
            target = skipped(_NO_IMAGE)
        elif sif:  # the author's reference
            target = done(role.sif) if role.sif else skipped(_NO_SIF)
        else:
            target = done(role.image)
        if target.value is None:
            return skipped(f"compose service {service!r} image: {target.reason}")
        targets[service] = target.value
    return done(targets)


def _image_target(image: ImageRecord | None, *, sif: bool) -> Step[str]:
    if image is None:
        return skipped(_NO_IMAGE)
    if image.error:
        return skipped(image.error)
    if sif:
        return done(image.sif) if image.sif else skipped(_NO_SIF)
    if image.reference:
        return done(image.reference)
    if image.image_id:
        return skipped("built locally only (`build --no-push`); build with a registry to pin it")
    if image.sif_sha256:
        return skipped("built into the .sif store (`build --builder apptainer`): use --sif")
    return skipped("not built yet (run `harbor-hpc build`)")


def set_docker_image(text: str, value: str, *, table: tuple[str, ...] = ENVIRONMENT) -> str:
    """`text` (a task.toml) with `[TABLE].docker_image = value`, all else byte for byte.

    `table` is `ENVIRONMENT` or `VERIFIER_ENVIRONMENT`; a `[verifier.environment]` table that
    does not exist yet starts as a copy of `[environment]` without its docker_image (see the
    module's docstring).
    """
    original = tomllib.loads(text)
    present: Any = original
    for name in table[:-1]:
        present = present.get(name, {})
    had_key = "docker_image" in present.get(table[-1], {})
    fast = _edit_in_place(text, value, table, had_key=had_key)
    if fast is not None and fast[1]:
        return fast[0]  # certainly right: no need to build what it must parse to
    expected, parent = _expected(original, value, table)
    if fast is not None and _parses_to(fast[0], expected):
        return fast[0]
    try:
        document = tomlkit.parse(text)
        container: Any = document
        for name in table:
            if container.get(name) is None:
                container[name] = tomlkit.table()
                if name == table[-1] and table == VERIFIER_ENVIRONMENT:
                    container[name].update(copy.deepcopy(parent[name]))
            container = container[name]
        container["docker_image"] = value
        edited = tomlkit.dumps(document)
        if _crlf(text):  # tomlkit ends the lines it adds with LF
            edited = re.sub(r"(?<!\r)\n", "\r\n", edited)
    except tomlkit.exceptions.TOMLKitError as exc:
        raise ValueError(f"tomlkit cannot edit it ({exc})") from None
    if not _parses_to(edited, expected):
        raise ValueError("editing docker_image would change other values; edit it by hand")
    return edited


def _expected(
    original: dict[str, Any], value: str, table: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What task.toml `original` must parse to once `[TABLE].docker_image = value` (a new
    `[verifier.environment]` seeded from `[environment]`), and the table's parent in it."""
    expected = copy.deepcopy(original)
    parent = expected
    for name in table[:-1]:
        parent = parent.setdefault(name, {})
    if table[-1] not in parent:
        seed = {k: v for k, v in original.get("environment", {}).items() if k != "docker_image"}
        parent[table[-1]] = seed if table == VERIFIER_ENVIRONMENT else {}
    parent[table[-1]]["docker_image"] = value
    return expected, parent


@functools.lru_cache(maxsize=1024)
def _quoted(value: str) -> str:
    """`value` as a TOML string, as tomlkit writes it (tasks share few images)."""
    return tomlkit.string(value).as_string()


def _header(table: tuple[str, ...]) -> re.Pattern[str]:
    """A line `[a.b]` (spaces allowed around names and dots, a comment after) for `table`, with
    its line ending (group 1: CRLF, LF, or empty on a last line without one)."""
    names = r"[ \t]*\.[ \t]*".join(re.escape(name) for name in table)
    return re.compile(rf"^[ \t]*\[[ \t]*{names}[ \t]*\][ \t]*(?:#[^\r\n]*)?(\r?\n|\Z)", re.M)


def _crlf(text: str) -> bool:
    """Whether every line of `text` ends in CRLF, so that lines added to it must too."""
    return "\r\n" in text and text.count("\n") == text.count("\r\n")


def _edit_in_place(
    text: str, value: str, table: tuple[str, ...], *, had_key: bool
) -> tuple[str, bool] | None:
    """Replace the string of a plain `docker_image = "..."` line of [TABLE], or add the line
    right under the `[TABLE]` header; None when there is no such header.

    The flag says the edit is certainly right without parsing it back: with no multi-line
    string in the file, every line-start match is real TOML structure, so the header is the
    table's and the key line (found exactly when the table had the key) is that key's.
    """
    header = _header(table).search(text)
    if header is None:
        return None
    certain = '"""' not in text and "'''" not in text
    quoted = _quoted(value)
    next_header = _ANY_HEADER.search(text, header.end())
    end = next_header.start() if next_header else len(text)
    line = _DOCKER_IMAGE_LINE.search(text, header.end(), end)
    if line is None:
        added = f"docker_image = {quoted}"
        if header.group(1):  # under the header, ending as its line does
            edited = f"{text[: header.end()]}{added}{header.group(1)}{text[header.end() :]}"
        else:  # the header ends the file without a newline: so does the added line
            edited = text + ("\r\n" if _crlf(text) else "\n") + added
        return edited, certain and not had_key
    return text[: line.start(2)] + quoted + text[line.end(2) :], certain and had_key


def _parses_to(text: str, expected: dict[str, Any]) -> bool:
    try:
        return tomllib.loads(text) == expected
    except tomllib.TOMLDecodeError:
        return False


_SERVICES = re.compile(r"^services[ \t]*:[ \t]*(?:#.*)?$", re.M)


def set_service_image(text: str, service: str, value: str) -> str:
    """`text` (a compose file) with the service's `image:` set to `value`, all else byte for
    byte (block style, as compose files are written; anything else is a ValueError)."""
    expected = yaml.safe_load(text)
    try:
        if expected["services"][service].get("image") == value:
            return text
        expected["services"][service]["image"] = value
    except (TypeError, KeyError, AttributeError):
        raise ValueError(f"no service {service!r} to set the image of") from None
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if _SERVICES.match(line.rstrip("\r\n"))), None)
    edited = None
    if start is not None:
        edited = _set_in_block(lines, start, service, json.dumps(value))  # YAML reads JSON strings
    if edited is None or yaml.safe_load(edited) != expected:
        raise ValueError(f"cannot set service {service!r}'s image in place; edit it by hand")
    return edited


def _set_in_block(lines: list[str], start: int, service: str, quoted: str) -> str | None:
    """Set `image:` in the block of `service` under the `services:` line `start`."""
    header = re.compile(rf"^([ \t]+){re.escape(service)}[ \t]*:[ \t]*(?:#.*)?$")
    services_indent = None
    for index in range(start + 1, len(lines)):
        line = lines[index].rstrip("\r\n")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            return None  # the next top-level key: no such service
        depth = len(line) - len(line.lstrip())
        services_indent = services_indent or depth
        found = header.match(line)
        if found is None or depth != services_indent:
            continue  # not a service's name (a key deeper in another service, say)
        indent = len(found.group(1))
        ending = lines[index][len(line) :] or "\n"
        child = None
        for inner in range(index + 1, len(lines)):
            body = lines[inner].rstrip("\r\n")
            if not body.strip() or body.lstrip().startswith("#"):
                continue
            depth = len(body) - len(body.lstrip())
            if depth <= indent:
                break
            child = child or depth
            image = re.match(rf"^([ \t]{{{child}}}image[ \t]*:[ \t]*)(.*?)([ \t]*(?:#.*)?)$", body)
            if depth == child and image is not None:
                rest = lines[inner][len(body) :]
                lines[inner] = image.group(1) + quoted + image.group(3) + rest
                return "".join(lines)
        lines.insert(index + 1, f"{' ' * (child or indent + 2)}image: {quoted}{ending}")
        return "".join(lines)
    return None


def unified_diff(task: Task, path: Path, old: str, new: str) -> str:
    name = f"{task.rel}/{'task.toml' if path.name == 'task.toml' else 'environment/' + path.name}"
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{name}", f"b/{name}"
    )
    return "".join(lines)
