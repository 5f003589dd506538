"""`build --builder docker`: each context built by a Docker Engine, pushed, pinned by digest.

An image is not built again when the registry still resolves its recorded digest or its content
tag, nor pushed again from a local copy that is already there; with `push=False` (`--no-push`)
images are only built and tagged locally, and the manifest records their local ids.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors

from harbor_hpc.core.files import atomic_write_text
from harbor_hpc.images import engine
from harbor_hpc.images.build import (
    Builder,
    BuildPlan,
    ImageAction,
    ImageFailed,
    PlannedImage,
    one_line,
)
from harbor_hpc.images.context import DOCKERFILE
from harbor_hpc.images.engine import BuilderKind
from harbor_hpc.images.registry import Registry, login_hint
from harbor_hpc.tasks.manifest import ImageRecord

_AUTH_REFUSALS = ("unauthorized", "authentication required", "no basic auth", "denied")


class DockerBuilder(Builder):
    """One Docker client per worker thread; the registry asked before each build."""

    kind = BuilderKind.DOCKER

    def __init__(self, plan: BuildPlan, *, push: bool = True, nohttps: bool = False) -> None:
        self.plan = plan
        self.registry = Registry(plan.registry.host, plain_http=nohttps) if push else None
        self._local = threading.local()

    @property
    def destination(self) -> str:
        return str(self.plan.registry)

    def prepare(self, plan: BuildPlan) -> None:
        engine.ping()
        if self.registry is not None and plan.images:
            self.registry.check_access(next(iter(plan.images.values())).reference.repository)

    @property
    def api(self) -> docker.APIClient:
        client: docker.APIClient | None = getattr(self._local, "api", None)
        if client is None:
            # No read timeout: a RUN may print nothing for longer than any fixed limit.
            client = docker.from_env(timeout=None).api
            self._local.api = client
        return client

    def make(
        self, image: PlannedImage, record: ImageRecord, log: Path, progress: Callable[[str], None]
    ) -> ImageAction:
        try:
            return self._make(image, record, log, progress)
        except docker.errors.DockerException as exc:
            raise ImageFailed(f"Docker: {one_line(str(exc))}") from None

    def _make(
        self, image: PlannedImage, record: ImageRecord, log: Path, progress: Callable[[str], None]
    ) -> ImageAction:
        if self.registry is None:
            action = ImageAction.LOCAL
            if self._local_image_id(image.tagged) is None:
                self._build(image, log, progress)
                action = ImageAction.BUILT_LOCAL
            record.image_id = self._local_image_id(image.tagged)
            return action
        path = image.reference.repository
        if record.digest and self.registry.manifest_digest(path, record.digest):
            return ImageAction.IN_REGISTRY
        progress("asking the registry")
        digest = self.registry.manifest_digest(path, image.tag)
        if digest:
            record.digest = digest
            return ImageAction.FOUND
        action = ImageAction.PUSHED
        if self._local_image_id(image.tagged) is None:
            self._build(image, log, progress)
            action = ImageAction.BUILT_PUSHED
        record.image_id = self._local_image_id(image.tagged)
        record.digest = self._push(image, progress)
        return action

    def _local_image_id(self, tagged: str) -> str | None:
        try:
            info: dict[str, Any] = self.api.inspect_image(tagged)
        except docker.errors.ImageNotFound:
            return None
        image_id: str = info["Id"]
        return image_id

    def _build(self, image: PlannedImage, log: Path, progress: Callable[[str], None]) -> None:
        progress("building")
        dockerfile = image.build_dir / DOCKERFILE
        # A symlinked Dockerfile is sent by content (docker-py does so for a path outside the
        # context), as it was hashed; a plain one by name.
        dockerfile_arg = os.path.realpath(dockerfile) if dockerfile.is_symlink() else DOCKERFILE
        lines: list[str] = []
        error = None
        stream: Iterator[dict[str, Any]] = self.api.build(
            path=str(image.build_dir),
            dockerfile=dockerfile_arg,
            tag=image.tagged,
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
            buildargs=self.plan.build_args,
        )
        for chunk in stream:
            text = chunk.get("stream") or chunk.get("status") or ""
            lines.extend(line for line in text.splitlines() if line.strip())
            if "error" in chunk:
                error = one_line(str(chunk["error"]))
                lines.append(f"ERROR: {chunk['error']}")
            elif text.strip():
                progress(one_line(text)[:80])
        atomic_write_text(log, "\n".join(lines) + "\n")
        if error:
            raise ImageFailed(f"build failed: {error} (log: {log})")

    def _push(self, image: PlannedImage, progress: Callable[[str], None]) -> str:
        progress("pushing")
        host = self.plan.registry.host
        digest = None
        for chunk in self.api.push(image.repository, tag=image.tag, stream=True, decode=True):
            if "error" in chunk:
                message = one_line(str(chunk["error"]))
                if any(word in message.lower() for word in _AUTH_REFUSALS):
                    raise ImageFailed(f"push to {host} refused ({message}): {login_hint(host)}")
                raise ImageFailed(f"push to {host} failed: {message}")
            aux = chunk.get("aux") or {}
            digest = aux.get("Digest") or digest
        if self.registry is not None and not digest:
            digest = self.registry.manifest_digest(image.reference.repository, image.tag)
        if not digest:
            raise ImageFailed(f"push to {host} reported no digest for {image.tagged}")
        return str(digest)
