"""Image references, split once into the parts a registry's v2 API takes.

One type serves both ends: `build --registry REGISTRY/NAMESPACE` (a host and the path images go
under, no tag) and the images themselves (`REGISTRY/NAMESPACE/NAME:TAG`, `...@sha256:...`,
`docker://...`, or a Docker Hub short name such as `ubuntu`). A registry target must name its
host: pushing to Docker Hub by accident is worse than an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from harbor_hpc.core.errors import InputError

DOCKER_HUB = "registry-1.docker.io"
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_REPOSITORY = re.compile(r"[a-z0-9]+(?:[._/-][a-z0-9]+)*")


def _is_host(part: str) -> bool:
    """Whether the first part of a reference is a registry host (as Docker decides it)."""
    return "." in part or ":" in part or part == "localhost"


# Registries Docker speaks plain HTTP to without being told (loopback: its implicit insecure
# registries); harbor-hpc does the same for Apptainer, which would need --nohttps.
LOOPBACK_HOSTS = ("localhost", "127.", "[::1]")


def is_loopback(host: str) -> bool:
    return host.startswith(LOOPBACK_HOSTS)


@dataclass(frozen=True)
class Reference:
    """`host` is the registry's (with its port), `repository` the path below it (empty for a
    registry target without a namespace)."""

    host: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Reference:
        """An image reference; without a tag or digest it means `:latest`, as for Docker."""
        rest = text.removeprefix("docker://")
        digest = None
        if "@" in rest:
            rest, digest = rest.split("@", 1)
            if not DIGEST.match(digest):
                raise InputError(
                    f"{text}: {digest!r} is not a sha256 digest",
                    hint="write a reference as REGISTRY/NAMESPACE/NAME@sha256:<64 hex digits>",
                )
        tag = None
        last = rest.rsplit("/", 1)[-1]
        if ":" in last:
            rest, tag = rest.rsplit(":", 1)
        if not rest:
            raise InputError(f"{text!r} is not an image reference")
        first, _, remainder = rest.partition("/")
        if remainder and _is_host(first):
            host, repository = first, remainder
        else:
            host, repository = DOCKER_HUB, rest if "/" in rest else f"library/{rest}"
        if not _REPOSITORY.fullmatch(repository):
            raise InputError(
                f"{text!r} is not an image reference (bad repository name {repository!r})",
                hint="names are lowercase, e.g. localhost:5000/ns/name@sha256:...",
            )
        if tag is None and digest is None:
            tag = "latest"
        return cls(host, repository, tag, digest)

    @classmethod
    def registry_target(cls, value: str) -> Reference:
        """`REGISTRY/NAMESPACE` as `--registry` gives it: where `build` pushes."""
        host, _, namespace = value.strip().strip("/").partition("/")
        if not host or not _is_host(host):
            raise InputError(
                f"--registry {value!r} does not start with a registry host",
                hint="give REGISTRY/NAMESPACE, e.g. registry.example.org/team or localhost:5000/me",
            )
        if namespace and not _REPOSITORY.fullmatch(namespace):
            raise InputError(
                f"--registry {value!r}: namespace {namespace!r} is not a valid repository path",
                hint="use lowercase letters, digits and . _ - / only",
            )
        return cls(host, namespace)

    def child(self, name: str, tag: str) -> Reference:
        """The image `name:tag` under this registry target."""
        return Reference(self.host, "/".join(p for p in (self.repository, name) if p), tag)

    @property
    def name(self) -> str:
        """`REGISTRY/REPOSITORY`: what Docker tags and pushes, without tag or digest."""
        return "/".join(part for part in (self.host, self.repository) if part)

    @property
    def pinned(self) -> str:
        """`docker://` URI fixed to the digest (which must be known)."""
        return f"docker://{self.name}@{self.digest}"

    def __str__(self) -> str:
        tag = f":{self.tag}" if self.tag else ""
        digest = f"@{self.digest}" if self.digest else ""
        return f"{self.name}{tag}{digest}"
