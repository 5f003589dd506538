"""`build`: one image per distinct build context, recorded in the manifest as its tasks' image.

Planning (`plan_build`) discovers the tasks and hashes each context; tasks with equal hashes share
one image named from the hash alone (`REGISTRY/NAMESPACE/env-<hash12>:<hash>`, or
`env-<hash12>` in the .sif store), so any rerun, from any manifest, finds what an earlier run
made. A task whose Dockerfile copies from above its
context gets its own error instead of an image: Docker cannot send such a file, and equal hashes
would no longer mean equal images. Build args (`--build-arg`, none by default, as in Harbor's own
build) are passed to every build; those a Dockerfile declares with `ARG` are part of its context's
hash and recorded with its image, so one context built with other values is another image. The
others (Docker's predefined proxy args among them) do not change what the Dockerfile builds.
What the hash deliberately leaves out is the base image behind a `FROM` tag: a rerun trusts what
it pushed before; pin `FROM` by digest to rebuild on a new base.

A task whose verifier runs in a container of its own (Harbor's separate verifier mode) with a
`tests/Dockerfile` has a second context, tests/, hashed, shared and named by the same rules: an
image is an image whichever role it plays. Its tasks are the image's `verifier_tasks`. A separate
verifier whose `[verifier.environment] docker_image` the task author set (and no tests/Dockerfile)
is recorded as that reference, for `convert` and `rewrite --sif`. A compose file is read as the
environment reads it: what its services ask that cannot be run here is warned about. Its
services' `build:` contexts are built into the .sif store when a trial first starts them.

Running (`run_build`) records the plan in the manifest first, then makes the distinct images in
parallel through one `Builder`; each finished image (made, or failed with its error) is written
to the manifest at once, so an interrupted build keeps what it finished and a rerun makes only
what is missing. The builders: Docker (images/docker_builder.py: build, push, pin by digest;
nothing is built again that the registry still holds) and Apptainer (containers/builder.py, a
layer up since it fills the .sif store: each context built from its Dockerfile straight into a
checked .sif, no Docker Engine and no registry involved). `build --builder auto` takes Docker
where an engine answers (`choose_builder`).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from harbor_hpc.core.batch import Step, done, failed
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.core.files import text_of
from harbor_hpc.images.context import DOCKERFILE, FileDigests, context_hash
from harbor_hpc.images.dockerfile import read_dockerfile
from harbor_hpc.images.engine import BuilderKind
from harbor_hpc.images.reference import Reference
from harbor_hpc.tasks.discovery import Task, TaskProblem, compose_file, discover_tasks
from harbor_hpc.tasks.manifest import (
    ImageRecord,
    Manifest,
    RoleImage,
    TaskRecord,
    update_manifest,
)

log = logging.getLogger(__name__)

# The role of a separate verifier's context (tasks' own have "", compose services their name).
VERIFIER = "\0verifier"
# Below this many tasks, starting worker processes costs more than it saves.
_PARALLEL_HASH_MIN = 500
# Contexts a hashing worker is sent at a time.
_HASH_BATCH = 256
_AUTH_REFUSALS = ("unauthorized", "authentication required", "no basic auth", "denied")


@dataclass
class PlannedImage:
    """One distinct context: the image it becomes and the tasks that share it."""

    context: str
    # REGISTRY/NAMESPACE/env-<hash12>:<hash> (`image_name`).
    reference: Reference
    build_dir: Path
    tasks: list[str] = field(default_factory=list)
    # Tasks whose separate verifier runs in this image.
    verifier_tasks: list[str] = field(default_factory=list)
    # (task, compose service) whose service runs in this image.
    services: list[tuple[str, str]] = field(default_factory=list)
    # The build args its Dockerfile declares, as given: part of the context hash.
    build_args: dict[str, str] = field(default_factory=dict)

    @property
    def users(self) -> list[str]:
        """Every task that needs this image, in either role."""
        return sorted({*self.tasks, *self.verifier_tasks, *(task for task, _ in self.services)})

    @property
    def name(self) -> str:
        """`env-<hash12>`: the image's own name, for logs and progress."""
        return image_name(self.context)[0]

    @property
    def repository(self) -> str:
        return self.reference.name

    @property
    def tag(self) -> str:
        return self.context

    @property
    def tagged(self) -> str:
        return str(self.reference)


@dataclass
class BuildPlan:
    root: Path
    # Where the images go: REGISTRY/NAMESPACE (empty for a build into the .sif store).
    registry: Reference
    images: dict[str, PlannedImage]
    task_errors: dict[str, str]
    problems: list[TaskProblem]
    # Task -> why its separate verifier's tests/ context cannot be built.
    verifier_errors: dict[str, str] = field(default_factory=dict)
    # Task -> the `[verifier.environment] docker_image` its author set (nothing to build).
    verifier_references: dict[str, str] = field(default_factory=dict)
    # Task -> why its compose services cannot run here (tasks/compose.py names it).
    compose: dict[str, str] = field(default_factory=dict)
    # Task -> its compose services' `image:` references (nothing to build; `convert` takes them).
    service_references: dict[str, dict[str, str]] = field(default_factory=dict)
    # Every build arg given, passed to every build (each image hashes those it declares).
    build_args: dict[str, str] = field(default_factory=dict)

    @property
    def task_count(self) -> int:
        return sum(len(image.tasks) for image in self.images.values()) + len(self.task_errors)

    @property
    def tasks(self) -> set[str]:
        return {task for image in self.images.values() for task in image.tasks} | set(
            self.task_errors
        )

    def status(self, context: str, recorded: Manifest | None) -> str:
        """What a dry run says of an image, given the manifest of earlier runs (if any)."""
        record = recorded.images.get(context) if recorded else None
        if record and record.digest:
            return "recorded (checked against the registry on a real run)"
        if record and record.sif_sha256:
            return "recorded (checked in the .sif store on a real run)"
        return "to build"

    def to_json(self, recorded: Manifest | None) -> dict[str, Any]:
        return {
            "tasks": self.task_count,
            "contexts": len(self.images),
            "images": [
                {
                    "context": key,
                    "image": image.tagged,
                    "tasks": image.tasks,
                    "verifier_tasks": image.verifier_tasks,
                    "services": [list(pair) for pair in image.services],
                    "build_args": image.build_args,
                    "status": self.status(key, recorded),
                }
                for key, image in self.images.items()
            ],
            "task_errors": self.task_errors,
            "verifier_errors": self.verifier_errors,
            "verifier_references": self.verifier_references,
            "compose": self.compose,
            "service_references": self.service_references,
            "problems": [problem.to_json() for problem in self.problems],
        }


@dataclass(frozen=True)
class BuildPreview:
    """What `build --dry-run` shows: the plan, each image's status read from the manifest of
    earlier runs (None when there is none yet)."""

    plan: BuildPlan
    recorded: Manifest | None

    def to_json(self) -> dict[str, Any]:
        return self.plan.to_json(self.recorded)


def image_name(context: str) -> tuple[str, str]:
    """Repository name and tag for a context hash: stable, derived from the content alone."""
    return f"env-{context[:12]}", context


def parse_build_args(values: Iterable[str]) -> dict[str, str]:
    """`NAME=VALUE` strings as a dict; a later NAME wins, as with `docker build`."""
    build_args = {}
    for value in values:
        key, has_value, text = value.partition("=")
        if not has_value or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise InputError(
                f"build arg {value!r} is not NAME=VALUE",
                hint="write --build-arg NAME=VALUE, NAME as the Dockerfile's ARG spells it",
            )
        build_args[key] = text
    return build_args


def plan_build(
    root: Path,
    registry: str | None,
    *,
    jobs: int = 2,
    build_args: Mapping[str, str] | None = None,
) -> BuildPlan:
    """Discover the tasks under `root` and group them by build context. Reads only.

    `registry` is where the images go (REGISTRY/NAMESPACE); None names them without one, for a
    build straight into the .sif store.

    Hashing is CPU-bound Python (the .dockerignore walk), so large datasets are hashed in `jobs`
    processes.
    """
    given = dict(build_args or {})
    target = Reference.registry_target(registry) if registry else Reference("", "")
    with _ContextHashes(jobs, given) as hashes:
        # Each task's environment is hashed from the moment the walk finds it.
        discovery = discover_tasks(
            root, found=lambda task: hashes.add(task.rel, "", task.environment_dir)
        )
        plan = BuildPlan(discovery.root, target, {}, {}, discovery.problems, build_args=given)
        verifiers = [
            (task, folder, VERIFIER)
            for task in discovery.tasks
            if (folder := task.verifier_build_dir) is not None
        ]
        for task, folder, role in verifiers:
            hashes.add(task.rel, role, folder)
        contexts = hashes.results()
        # The hashing saw which environments hold a compose file: their services' contexts.
        services = [
            (task, folder, service)
            for task in discovery.tasks
            if contexts[(task.rel, "")][1]
            for service, folder in _compose_contexts(task, plan)
        ]
        for task, folder, role in services:
            hashes.add(task.rel, role, folder)
        contexts.update(hashes.results())
    # (task, context folder, role): the environment's (role ""), separate verifiers'
    # (VERIFIER), compose services' (the service's name).
    roles = [(task, task.environment_dir, "") for task in discovery.tasks] + verifiers + services
    for task, folder, role in roles:
        step = contexts[(task.rel, role)][0]
        if step.value is None:
            if role == VERIFIER:
                plan.verifier_errors[task.rel] = step.reason
            elif role:
                plan.compose[task.rel] = f"service {role!r}: {step.reason}"
            else:
                plan.task_errors[task.rel] = step.reason
            continue
        key, used = step.value
        image = plan.images.get(key)
        if image is None:
            name, tag = image_name(key)
            image = PlannedImage(key, target.child(name, tag), folder, build_args=used)
            plan.images[key] = image
        if role == VERIFIER:
            image.verifier_tasks.append(task.rel)
        elif role:
            image.services.append((task.rel, role))
        else:
            image.tasks.append(task.rel)
    for task in discovery.tasks:
        if not task.separate_verifier or task.verifier_build_dir is not None:
            continue
        if task.verifier_docker_image:
            plan.verifier_references[task.rel] = task.verifier_docker_image
        elif "tests/docker-compose.yaml" in task.compose_files():
            plan.verifier_errors[task.rel] = (
                f"{task.rel}/tests/docker-compose.yaml: a verifier environment made of compose "
                "services cannot run under Apptainer; give it a tests/Dockerfile"
            )
    return plan


class _ContextHashes:
    """Build contexts hashed as they are named (`add`): in this process while they are few, in
    `jobs` worker processes once there are many (batches go out while the rest are still being
    found); `results` waits for every one named since it was last called."""

    def __init__(self, jobs: int, build_args: dict[str, str]) -> None:
        self._jobs = jobs
        self._build_args = build_args
        self._workers = _hashing_workers() if jobs > 1 else None
        self._pool: ProcessPoolExecutor | None = None
        self._waiting: list[tuple[str, str, str]] = []
        self._sent: list[tuple[list[tuple[str, str, str]], Future[list[_Hashed]]]] = []

    def __enter__(self) -> _ContextHashes:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def add(self, task: str, role: str, folder: Path) -> None:
        """Hash `folder`, the context of `task`'s `role` (see `plan_build`)."""
        self._waiting.append((task, role, str(folder)))
        if self._workers is None:
            return
        if self._pool is None and len(self._waiting) >= _PARALLEL_HASH_MIN:
            self._pool = ProcessPoolExecutor(
                max_workers=self._jobs, mp_context=self._workers, initializer=_reset_worker_hashing
            )
        if self._pool is not None and len(self._waiting) >= _HASH_BATCH:
            self._send()

    def _send(self) -> None:
        assert self._pool is not None
        batch, self._waiting = self._waiting, []
        self._sent.append((batch, self._pool.submit(_hash_in_worker, batch, self._build_args)))

    def results(self) -> dict[tuple[str, str], _Hashed]:
        """Each context's hash (or why it has none), by (task, role)."""
        if self._pool is None:
            hashing = _Hashing()
            batch, self._waiting = self._waiting, []
            hashed = _hash_in_worker(batch, self._build_args, hashing)
            return {(task, role): out for (task, role, _), out in zip(batch, hashed, strict=True)}
        if self._waiting:
            self._send()
        sent, self._sent = self._sent, []
        return {
            (task, role): out
            for batch, future in sent
            for (task, role, _), out in zip(batch, future.result(), strict=True)
        }


def _hashing_workers() -> multiprocessing.context.ForkServerContext:
    """How hashing workers start: forked from a server process, as forking this one, which may
    run threads (docker's, rich's), can deadlock. The server starts now, in the background,
    and loads what hashing needs (docker-py, above all) while this process discovers the
    tasks: workers forked from it then start at once, not each loading it anew."""
    workers = multiprocessing.get_context("forkserver")
    workers.set_forkserver_preload([__name__, "docker.utils.build"])
    multiprocessing.forkserver.ensure_running()
    return workers


def _compose_contexts(task: Task, plan: BuildPlan) -> list[tuple[str, Path]]:
    """The task's compose services' `build:` contexts, (service, folder); their `image:`
    references into `plan.service_references`, and what cannot run into `plan.compose`."""
    from harbor_hpc.tasks.compose import UnsupportedCompose, load_compose

    try:
        compose = load_compose(task.environment_dir)
    except UnsupportedCompose as exc:
        plan.compose[task.rel] = str(exc)
        return []
    if compose is None:  # its compose file went away since
        return []
    contexts = []
    for service in compose.services:
        # A context wins over an `image:` (which `rewrite` sets to what the context built).
        if service.build is not None:
            contexts.append((service.name, service.build))
        elif service.image:
            plan.service_references.setdefault(task.rel, {})[service.name] = service.image
    return contexts


@dataclass
class _Hashing:
    """What one plan has read so far: file digests, and what each Dockerfile text (with the
    build args given) says (its first source outside the context, if any; the args it
    declares), so equal Dockerfiles are read once."""

    digests: FileDigests = field(default_factory=FileDigests)
    dockerfiles: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str | None, set[str]]] = field(
        default_factory=dict
    )


# One per hashing worker process, fresh for each plan: a cache outliving the files it
# describes could mistake a new file for an old one that had the same inode, size and mtime.
_worker_hashing = _Hashing()


def _reset_worker_hashing() -> None:
    global _worker_hashing
    _worker_hashing = _Hashing()


# A hashed context: its hash and the build args of those given that its Dockerfile declares.
_Context = tuple[str, dict[str, str]]
# What hashing a context found: its hash (or why it has none), and, for a task's own
# environment, whether it holds a compose file.
_Hashed = tuple[Step[_Context], bool]


def _hash_in_worker(
    batch: list[tuple[str, str, str]], build_args: dict[str, str], hashing: _Hashing | None = None
) -> list[_Hashed]:
    """Each (task, role, context folder) of `batch` hashed."""
    hashing = hashing or _worker_hashing
    return [
        (
            _task_context(task, folder, build_args, hashing),
            not role and compose_file(Path(folder)) is not None,
        )
        for task, role, folder in batch
    ]


def _task_context(
    rel: str, context: str, build_args: dict[str, str], hashing: _Hashing
) -> Step[_Context]:
    """A task's context hash, or why it cannot be built as its own context."""
    try:
        text = text_of(hashing.digests.read(os.path.join(context, DOCKERFILE)), "replace")
        memo = (text, tuple(build_args.items()))
        known = hashing.dockerfiles.get(memo)
        if known is None:
            dockerfile = read_dockerfile(text, build_args)
            outside = dockerfile.outside[0] if dockerfile.outside else None
            known = hashing.dockerfiles[memo] = (outside, set(dockerfile.args))
        outside, declared = known
        if outside is not None:
            folder = os.path.basename(context)
            return failed(
                f"{rel}/{folder}/Dockerfile: {outside} reaches outside the "
                f"build context ({folder}/), which Docker does not send; move the file into "
                f"{folder}/"
            )
        used = {key: value for key, value in build_args.items() if key in declared}
        return done((context_hash(Path(context), hashing.digests, used), used))
    except OSError as exc:
        where = exc.filename or context
        return failed(f"cannot read the build context: {where}: {exc.strerror}")


class ImageAction(StrEnum):
    """What a build did for one image: nothing (it was there), a build, a push, or failed."""

    LOCAL = "already built locally"
    BUILT_LOCAL = "built (local only)"
    IN_REGISTRY = "already in the registry"
    FOUND = "found in the registry"
    PUSHED = "pushed"
    BUILT_PUSHED = "built and pushed"
    IN_STORE = "already in the store"
    BUILT_SIF = "built into the store"
    FAILED = "failed"


@dataclass
class ImageOutcome:
    """What happened to one planned image; a failed one's error is in `record.error`."""

    image: PlannedImage
    record: ImageRecord
    action: ImageAction

    @property
    def failed(self) -> bool:
        return self.record.error is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "image": self.image.tagged,
            "reference": self.record.reference,
            "image_id": self.record.image_id,
            "sif": self.record.sif,
            "sif_sha256": self.record.sif_sha256,
            "tasks": len(self.image.tasks),
            "verifier_tasks": len(self.image.verifier_tasks),
            "action": self.action,
            "error": self.record.error,
        }


@dataclass
class BuildResult:
    manifest: Path
    outcomes: list[ImageOutcome]
    task_errors: dict[str, str]
    problems: list[TaskProblem]
    verifier_errors: dict[str, str] = field(default_factory=dict)
    builder: BuilderKind = BuilderKind.DOCKER

    @property
    def failed_tasks(self) -> list[str]:
        """Tasks left without an image for their environment or their verifier."""
        failed = {task for o in self.outcomes if o.failed for task in o.image.users}
        return sorted(failed | set(self.task_errors) | set(self.verifier_errors))

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest": str(self.manifest),
            "builder": self.builder,
            "images": [outcome.to_json() for outcome in self.outcomes],
            "failed_tasks": self.failed_tasks,
            "task_errors": self.task_errors,
            "verifier_errors": self.verifier_errors,
            "problems": [problem.to_json() for problem in self.problems],
        }


ProgressCallback = Callable[[PlannedImage, str], None]


class Builder(ABC):
    """One backend that makes planned images: `run_build` calls `prepare` once, then `make` for
    each image from worker threads, and records what `make` filled in."""

    kind: BuilderKind

    @property
    @abstractmethod
    def destination(self) -> str:
        """Where the images go, as the manifest records it (`registry`)."""

    @abstractmethod
    def prepare(self, plan: BuildPlan) -> None:
        """Raise `HarborHpcError` when nothing can be built here, before the manifest changes."""

    @abstractmethod
    def make(
        self, image: PlannedImage, record: ImageRecord, log: Path, progress: Callable[[str], None]
    ) -> ImageAction:
        """Make `image` (or find it made) and fill `record` in; the build's output goes to
        `log`. Raises `ImageFailed` (one line naming what failed, and the log) or
        `HarborHpcError`."""


class ImageFailed(Exception):
    """One image could not be built or pushed; its tasks get the message."""


def run_build(
    plan: BuildPlan,
    manifest_path: Path,
    builder: Builder,
    *,
    jobs: int = 2,
    on_progress: ProgressCallback | None = None,
    on_done: Callable[[ImageOutcome], None] | None = None,
) -> BuildResult:
    """Make every planned image not already made; the manifest follows along."""
    builder.prepare(plan)
    _record_plan(plan, manifest_path, builder.destination)
    # What a build prints may quote what it was given (build args, its files): the user's alone.
    logs = build_logs(manifest_path)
    logs.mkdir(mode=0o700, exist_ok=True)
    logs.chmod(0o700)
    worker = _Worker(manifest_path, builder, on_progress or (lambda image, text: None))
    outcomes: list[ImageOutcome] = []
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        for outcome in pool.map(worker.run, plan.images.values()):
            outcomes.append(outcome)
            if on_done:
                on_done(outcome)
    except KeyboardInterrupt:
        # Start nothing new; builds under way finish and are recorded, the rest wait for a rerun.
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return BuildResult(
        manifest_path,
        outcomes,
        plan.task_errors,
        plan.problems,
        plan.verifier_errors,
        builder.kind,
    )


def _record_plan(plan: BuildPlan, manifest_path: Path, destination: str) -> None:
    """Point every planned task at its image in the manifest, keeping what earlier runs recorded."""
    fresh = Manifest(destination, str(plan.root))
    with update_manifest(manifest_path, create=fresh) as manifest:
        if manifest.registry != fresh.registry:
            raise InputError(
                f"{manifest_path} records images in {manifest.registry}, not {fresh.registry}",
                hint="use another --manifest file for another registry, store or builder",
            )
        manifest.tasks_root = fresh.tasks_root
        planned = plan.tasks
        recorded = {task: manifest.tasks.get(task) for task in planned}
        for key, record in list(manifest.images.items()):
            record.tasks = [task for task in record.tasks if task not in planned]
            record.verifier_tasks = [t for t in record.verifier_tasks if t not in planned]
            record.services = [pair for pair in record.services if pair[0] not in planned]
            unused = not (record.tasks or record.verifier_tasks or record.services)
            if unused and key not in plan.images:
                del manifest.images[key]
        for task in planned:  # each planned task's verifier is set afresh below
            manifest.tasks[task] = TaskRecord(None)
        for task, error in plan.task_errors.items():
            manifest.tasks[task] = TaskRecord(None, None, error)
        for key, image in plan.images.items():
            record = manifest.images.get(key) or ImageRecord(image.repository, image.tag)
            record.build_args = image.build_args
            record.tasks = sorted({*record.tasks, *image.tasks})
            record.verifier_tasks = sorted({*record.verifier_tasks, *image.verifier_tasks})
            pairs = {(task, service) for task, service in record.services} | set(image.services)
            record.services = [[task, service] for task, service in sorted(pairs)]
            manifest.set_image(key, record)
        for task, error in plan.verifier_errors.items():
            manifest.tasks[task].verifier = RoleImage(None, None, error)
        for task, reference in plan.verifier_references.items():
            manifest.tasks[task].verifier = _author_reference(reference, recorded.get(task), None)
        for task, services in plan.service_references.items():
            for service, reference in services.items():
                manifest.tasks[task].services[service] = _author_reference(
                    reference, recorded.get(task), service
                )


def _author_reference(
    reference: str, recorded: TaskRecord | None, service: str | None
) -> RoleImage:
    """The record of an author's `[verifier.environment] docker_image` (`service` None) or a
    compose service's `image:`, keeping the recorded reference and .sif when the task now names
    that .sif (`rewrite --sif` ran)."""
    before = recorded.role(service) if recorded else None
    kept = before is not None and before.context is None and before.image is not None
    if before is not None and kept and reference in (before.image, before.sif):
        return RoleImage(None, before.image, None, before.sif)
    return RoleImage(None, reference)


def build_logs(manifest_path: Path) -> Path:
    """The folder of the builds' output: beside the manifest, one file per image."""
    return manifest_path.parent / f"{manifest_path.stem}.build-logs"


def build_log(manifest_path: Path, image: PlannedImage) -> Path:
    """Where the build of `image` writes its output."""
    return build_logs(manifest_path) / f"{image.name}.log"


class _Worker:
    """Makes one image at a time per worker thread and records each in the manifest at once."""

    def __init__(self, manifest_path: Path, builder: Builder, on_progress: ProgressCallback):
        self.manifest_path = manifest_path
        self.builder = builder
        self.on_progress = on_progress

    def run(self, image: PlannedImage) -> ImageOutcome:
        with update_manifest(self.manifest_path) as manifest:
            record = manifest.images[image.context]
        log_file = build_log(self.manifest_path, image)
        try:
            action = self.builder.make(
                image, record, log_file, lambda text: self.on_progress(image, text)
            )
            record.error = None
        except ImageFailed as exc:
            action, record.error = ImageAction.FAILED, str(exc)
        except HarborHpcError as exc:
            action, record.error = ImageAction.FAILED, exc.message
        except OSError as exc:  # a context file that cannot be read, a full scratch disk
            action, record.error = ImageAction.FAILED, f"{exc.filename or image.name}: {exc}"
        with update_manifest(self.manifest_path) as manifest:
            current = manifest.images.get(image.context, record)
            record.tasks, record.verifier_tasks = current.tasks, current.verifier_tasks
            record.services = current.services
            if self.builder.kind is not BuilderKind.APPTAINER:
                # `convert` may have recorded a .sif meanwhile; a store build records its own.
                record.sif = current.sif or record.sif
            manifest.set_image(image.context, record)
        log_line = record.error or action
        log.info("%s (%d tasks): %s", image.tagged, len(image.users), log_line)
        self.on_progress(image, action)
        return ImageOutcome(image, record, action)


def one_line(text: str) -> str:
    """Tool output as one line of at most 300 characters, for an image's error."""
    text = re.sub(r"\s+", " ", text.strip())
    return text[:300]
