"""The manifest: which image every task runs in, pinned by digest, and where its .sif is.

`build` writes it as images finish, `convert` adds each image's .sif, `rewrite` and `submit` read
it. Images are keyed by the content hash of their build context, so tasks with the same context
share one entry. A task whose verifier runs in a container of its own (Harbor's separate
verifier) also records that image: one built from its tests/ folder (an entry of `images`, like
any other, listing the task among its `verifier_tasks`), or the reference its author set. The
JSON shape is described by `manifests/manifest.schema.json`; manifests written before verifier
images were recorded read as tasks whose verifier shares their container.

Several processes (parallel builds, conversions on many nodes) update one manifest, so every
change goes through `update_manifest`: lock, re-read, change, atomic write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harbor_hpc.core.errors import InputError
from harbor_hpc.core.files import atomic_write_json, file_lock, read_json

SCHEMA = "harbor-hpc/manifest/v1"


@dataclass
class ImageRecord:
    repository: str
    tag: str
    tasks: list[str] = field(default_factory=list)
    digest: str | None = None
    error: str | None = None
    sif: str | None = None
    # Local Docker image id of a `build --no-push` image: built here, not pinned in a registry.
    image_id: str | None = None
    # Tasks whose separate verifier runs in this image (built from their tests/ folder), and the
    # build args (`build --build-arg`) it was built with that its Dockerfile declares. Set after
    # construction, so that the constructor's arguments stay the strings they were.
    verifier_tasks: list[str] = field(default_factory=list, init=False)
    build_args: dict[str, str] = field(default_factory=dict, init=False)

    @property
    def reference(self) -> str | None:
        """`REGISTRY/NAMESPACE/NAME@sha256:...` once pushed, else None."""
        return f"{self.repository}@{self.digest}" if self.digest else None

    @property
    def tagged(self) -> str:
        return f"{self.repository}:{self.tag}"


@dataclass
class VerifierRecord:
    """The image of a task's separate verifier: built from tests/ (`context` is its key in
    `images`, whose record holds its .sif), or the author's reference (`context` None; `sif`
    is where `convert` put it)."""

    context: str | None
    image: str | None = None
    error: str | None = None
    sif: str | None = None


@dataclass
class TaskRecord:
    context: str | None
    image: str | None = None
    error: str | None = None
    # None: the verifier runs in the task's own container or image.
    verifier: VerifierRecord | None = None


@dataclass
class Manifest:
    registry: str
    tasks_root: str
    images: dict[str, ImageRecord] = field(default_factory=dict)
    tasks: dict[str, TaskRecord] = field(default_factory=dict)
    updated_at: str = ""

    def image_of(self, task: str) -> ImageRecord | None:
        record = self.tasks.get(task)
        if record is None or record.context is None:
            return None
        return self.images.get(record.context)

    def verifier_image_of(self, task: str) -> ImageRecord | None:
        record = self.tasks.get(task)
        if record is None or record.verifier is None or record.verifier.context is None:
            return None
        return self.images.get(record.verifier.context)

    def set_image(self, context: str, image: ImageRecord) -> None:
        """Store an image and bring each of its tasks' `image`/`error` (or their verifier's) in
        line with it."""
        self.images[context] = image
        for task in image.tasks:
            verifier = self.tasks[task].verifier if task in self.tasks else None
            self.tasks[task] = TaskRecord(context, image.reference, image.error, verifier)
        for task in image.verifier_tasks:
            record = self.tasks.setdefault(task, TaskRecord(None))
            record.verifier = VerifierRecord(context, image.reference, image.error)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "registry": self.registry,
            "tasks_root": self.tasks_root,
            "updated_at": self.updated_at,
            "images": {
                key: {**asdict(image), "reference": image.reference}
                for key, image in sorted(self.images.items())
            },
            "tasks": {key: asdict(task) for key, task in sorted(self.tasks.items())},
        }

    @classmethod
    def from_json(cls, data: Any, source: Path) -> Manifest:
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise InputError(
                f"{source}: not a harbor-hpc manifest (expected schema {SCHEMA!r})",
                hint="make one with `harbor-hpc build`",
            )
        try:
            images = {
                key: ImageRecord(
                    repository=value["repository"],
                    tag=value["tag"],
                    tasks=list(value.get("tasks", [])),
                    digest=value.get("digest"),
                    error=value.get("error"),
                    sif=value.get("sif"),
                    image_id=value.get("image_id"),
                )
                for key, value in data["images"].items()
            }
            for key, value in data["images"].items():
                images[key].verifier_tasks = list(value.get("verifier_tasks", []))
                images[key].build_args = dict(value.get("build_args", {}))
            tasks = {
                key: TaskRecord(
                    value.get("context"),
                    value.get("image"),
                    value.get("error"),
                    _verifier_from_json(value.get("verifier")),
                )
                for key, value in data["tasks"].items()
            }
            return cls(data["registry"], data["tasks_root"], images, tasks, data["updated_at"])
        except (KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{source}: malformed manifest (bad or missing {exc})") from None


def _verifier_from_json(value: Any) -> VerifierRecord | None:
    if value is None:
        return None
    return VerifierRecord(
        value.get("context"), value.get("image"), value.get("error"), value.get("sif")
    )


def load_manifest(path: Path) -> Manifest:
    return Manifest.from_json(read_json(path), path)


def save_manifest(path: Path, manifest: Manifest) -> None:
    manifest.updated_at = datetime.now(UTC).isoformat(timespec="seconds")
    atomic_write_json(path, manifest.to_json())


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def update_manifest(path: Path, *, create: Manifest | None = None) -> Iterator[Manifest]:
    """Lock the manifest, yield it fresh from disk for changes, write it back atomically.

    With `create`, a manifest that does not exist yet starts as `create`.
    """
    with file_lock(_lock_path(path)):
        manifest = load_manifest(path) if path.exists() or create is None else create
        yield manifest
        save_manifest(path, manifest)
