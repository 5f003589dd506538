"""The manifest: which image every task runs in, pinned by digest, and where its .sif is.

`build` writes it as images finish, `convert` adds each image's .sif, `rewrite` and `submit` read
it. Images are keyed by the content hash of their build context, so tasks with the same context
share one entry. A task whose verifier runs in a container of its own (Harbor's separate
verifier) also records that image: one built from its tests/ folder (an entry of `images`, like
any other, listing the task among its `verifier_tasks`), or the reference its author set; so
does each compose service beside it (an entry of `images` for a `build:` context, listing
`[task, service]` among its `services`, or the service's `image:` reference). The JSON shape
is described by the repository's `manifests/manifest.schema.json`, with examples beside it;
manifests written before verifier images were recorded read as tasks whose verifier shares
their container.

Several processes (parallel builds, conversions on many nodes) update one manifest, so every
change goes through `update_manifest`: lock, re-read, change, atomic write.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

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
    # [task, compose service] pairs whose service runs in this image (built from its context).
    services: list[list[str]] = field(default_factory=list, init=False)
    build_args: dict[str, str] = field(default_factory=dict, init=False)
    # The sha256 of a .sif `build --builder apptainer` made (`sif`): there is no registry digest.
    sif_sha256: str | None = field(default=None, init=False)

    @property
    def reference(self) -> str | None:
        """`REGISTRY/NAMESPACE/NAME@sha256:...` once pushed, else None."""
        return f"{self.repository}@{self.digest}" if self.digest else None

    @property
    def tagged(self) -> str:
        return f"{self.repository}:{self.tag}"


@dataclass
class RoleImage:
    """An image a task uses beside its own, for its separate verifier or a compose service:
    built here (`context` is its key in `images`, whose record holds its .sif), or the author's
    reference (`context` None; `sif` is where `convert` put it)."""

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
    verifier: RoleImage | None = None
    # Its compose services' images, by service name.
    services: dict[str, RoleImage] = field(default_factory=dict)

    def role(self, service: str | None) -> RoleImage | None:
        """The verifier's image (`service` None) or that compose service's."""
        return self.verifier if service is None else self.services.get(service)


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
            before = self.tasks.get(task) or TaskRecord(None)
            self.tasks[task] = TaskRecord(
                context, image.reference, image.error, before.verifier, before.services
            )
        for task in image.verifier_tasks:
            record = self.tasks.setdefault(task, TaskRecord(None))
            record.verifier = RoleImage(context, image.reference, image.error)
        for task, service in image.services:
            record = self.tasks.setdefault(task, TaskRecord(None))
            record.services[service] = RoleImage(context, image.reference, image.error)

    def author_images(self) -> Iterator[tuple[str, str | None, RoleImage]]:
        """(task, compose service or None for its verifier, image) for every image a task's
        author named rather than one built here."""
        for task, record in sorted(self.tasks.items()):
            roles = [(None, record.verifier), *sorted(record.services.items())]
            for service, role in roles:
                if role is not None and role.context is None and role.image:
                    yield task, service, role

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
        """The manifest in `data`, every value it reads checked as the schema says: a hand-edited
        value that would mislead `rewrite` or `convert` (a digest that is not one) is refused,
        naming the file, the entry and the value."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise InputError(
                f"{source}: not a harbor-hpc manifest (expected schema {SCHEMA!r})",
                hint="make one with `harbor-hpc build`",
            )
        top = _Entry(source, "", data)
        images = {}
        for key, value in top.objects("images").items():
            entry = top.child(f"images.{key}", value)
            image = ImageRecord(
                repository=entry.text("repository", _REPOSITORY),
                tag=entry.text("tag", _NAME),
                tasks=entry.texts("tasks"),
                digest=entry.optional("digest", _DIGEST),
                error=entry.optional("error"),
                sif=entry.optional("sif"),
                image_id=entry.optional("image_id", _DIGEST),
            )
            image.verifier_tasks = entry.texts("verifier_tasks", required=False)
            image.services = entry.pairs("services")
            image.build_args = entry.mapping("build_args")
            if "sif_sha256" in entry.data:
                image.sif_sha256 = entry.optional("sif_sha256", _DIGEST)
            images[key] = image
        tasks = {}
        for key, value in top.objects("tasks").items():
            entry = top.child(f"tasks.{key}", value)
            verifier = entry.data.get("verifier")
            tasks[key] = TaskRecord(
                entry.optional("context"),
                entry.optional("image", _PINNED),
                entry.optional("error"),
                None
                if verifier is None
                else _role_image(entry.child(f"tasks.{key}.verifier", verifier)),
                {
                    name: _role_image(entry.child(f"tasks.{key}.services.{name}", value))
                    for name, value in entry.objects("services", required=False).items()
                },
            )
        return cls(
            top.text("registry", _NAME),
            top.text("tasks_root"),
            images,
            tasks,
            top.text("updated_at"),
        )


def _role_image(entry: _Entry) -> RoleImage:
    context = entry.optional("context")
    # A built image's reference is pinned; an author's is theirs, whatever form it takes.
    image = entry.optional("image", _PINNED if context is not None else _REFERENCE)
    return RoleImage(context, image, entry.optional("error"), entry.optional("sif"))


class _Format(NamedTuple):
    pattern: re.Pattern[str]
    # What a value must be, for the error.
    what: str


_ANY = _Format(re.compile(r".*", re.S), "a string")
_NAME = _Format(re.compile(r".+", re.S), "a non-empty string")
_REPOSITORY = _Format(re.compile(r"[^@\s]+"), "a repository (REGISTRY/NAME, no '@' or spaces)")
_REFERENCE = _Format(re.compile(r"\S+"), "an image reference")
_DIGEST = _Format(re.compile(r"sha256:[0-9a-f]{64}"), "a digest (sha256:<64 hex digits>)")
_PINNED = _Format(
    re.compile(r"[^@\s]+@sha256:[0-9a-f]{64}"),
    "a pinned reference (REGISTRY/NAME@sha256:<64 hex digits>)",
)


@dataclass(frozen=True)
class _Entry:
    """One object of a manifest being read (`name` is where it is, `images.KEY`); every value
    taken from it is checked, and a bad one is an `InputError` naming the file, entry and value."""

    source: Path
    name: str
    data: dict[str, Any]

    def child(self, name: str, value: Any) -> _Entry:
        if not isinstance(value, dict):
            raise self._bad(name, value, "an object")
        return _Entry(self.source, name, value)

    def text(self, key: str, form: _Format = _ANY) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not form.pattern.fullmatch(value):
            raise self._bad(self._at(key), value, form.what)
        return value

    def optional(self, key: str, form: _Format = _ANY) -> str | None:
        return None if self._get(key) is None else self.text(key, form)

    def texts(self, key: str, *, required: bool = True) -> list[str]:
        value = self._get(key) if required else self.data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self._bad(self._at(key), value, "a list of strings")
        return list(value)

    def mapping(self, key: str) -> dict[str, str]:
        """An optional object of strings (absent: empty)."""
        value = self.data.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise self._bad(self._at(key), value, "an object of strings")
        return dict(value)

    def pairs(self, key: str) -> list[list[str]]:
        """An optional list of [string, string] (absent: empty)."""
        value = self.data.get(key, [])
        if not isinstance(value, list) or not all(
            isinstance(item, list) and len(item) == 2 and all(isinstance(s, str) for s in item)
            for item in value
        ):
            raise self._bad(self._at(key), value, "a list of [task, service] pairs")
        return [list(item) for item in value]

    def objects(self, key: str, *, required: bool = True) -> dict[str, Any]:
        value = self._get(key) if required else self.data.get(key, {})
        if not isinstance(value, dict):
            raise self._bad(self._at(key), value, "an object")
        return value

    def _get(self, key: str) -> Any:
        if key not in self.data:
            raise InputError(
                f"{self.source}: {self.name or 'the manifest'} has no {key!r}", hint=_FIX
            )
        return self.data[key]

    def _at(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def _bad(self, where: str, value: Any, what: str) -> InputError:
        shown = repr(value)
        if len(shown) > 100:
            shown = shown[:97] + "..."
        return InputError(f"{self.source}: {where} = {shown} is not {what}", hint=_FIX)


_FIX = "correct that value by hand, or run `harbor-hpc build` again to write the manifest anew"


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
