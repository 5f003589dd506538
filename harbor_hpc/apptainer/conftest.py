"""Shared fixtures for the .sif store's tests: a tiny image in both test registries, one .sif.

Converting a 200 MB image takes about 20 s here, so the image the store's tests convert is a
2 MB one built from the test base image (a shell and libc only): each conversion takes about a
second, and the session converts it once for every test that only needs a finished .sif.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harbor_hpc.apptainer.store import ensure_sif
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, save_manifest

TINY_DOCKERFILE = """\
FROM {base} AS base
FROM scratch
COPY --from=base /bin/dash /bin/sh
COPY --from=base /lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libc.so.6
COPY --from=base /lib64/ld-linux-x86-64.so.2 /lib64/ld-linux-x86-64.so.2
LABEL org.harbor-hpc.test={nonce}
"""

# Stands in for `apptainer`: logs each call's verb, can slow a pull down before or after the
# real one (to overlap concurrent converters, or to kill one mid-way), then runs the real binary.
RECORDER = """\
#!/bin/sh
echo "$1" >> {log}
if [ "$1" = pull ] || [ "$1" = build ]; then
    sleep "${{PULL_DELAY_BEFORE:-0}}"
    {real} "$@"
    status=$?
    sleep "${{PULL_DELAY_AFTER:-0}}"
    exit $status
fi
exec {real} "$@"
"""


@dataclass(frozen=True)
class TinyImage:
    tag: str  # in the local Docker daemon
    image_id: str
    open_ref: str  # REG/NS/NAME@sha256:... in the open registry
    auth_ref: str  # the same image in the password registry
    user: str
    password: str


@pytest.fixture(scope="session")
def tiny_image() -> Iterator[TinyImage]:
    import docker

    client = docker.from_env()
    base = os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    open_registry = os.environ["HARBOR_HPC_TEST_REGISTRY"]
    auth_registry = os.environ["HARBOR_HPC_TEST_AUTH_REGISTRY"]
    user = os.environ["HARBOR_HPC_TEST_AUTH_USER"]
    password = os.environ["HARBOR_HPC_TEST_AUTH_PASSWORD"]
    # A fresh label per session: a new digest, so no earlier run's .sif can stand in.
    nonce = uuid.uuid4().hex[:12]
    dockerfile = TINY_DOCKERFILE.format(base=base, nonce=nonce).encode()
    image, _ = client.images.build(
        fileobj=io.BytesIO(dockerfile), tag=f"harbor-hpc-test/tiny:{nonce}", rm=True
    )
    refs = []
    for registry, auth in (
        (open_registry, None),
        (auth_registry, {"username": user, "password": password}),
    ):
        repository = f"{registry}/harbor-hpc-test/tiny"
        image.tag(repository, tag=nonce)
        digest = None
        # The login goes with this one push only: no Docker config file is read or written.
        for line in client.images.push(
            repository, tag=nonce, auth_config=auth, stream=True, decode=True
        ):
            if "error" in line:
                raise RuntimeError(f"push to {registry} failed: {line['error']}")
            digest = line.get("aux", {}).get("Digest", digest)
        assert digest, f"push to {registry} reported no digest"
        refs.append(f"{repository}@{digest}")
    yield TinyImage(f"harbor-hpc-test/tiny:{nonce}", image.id, refs[0], refs[1], user, password)
    for name in (
        f"harbor-hpc-test/tiny:{nonce}",
        f"{open_registry}/harbor-hpc-test/tiny:{nonce}",
        f"{auth_registry}/harbor-hpc-test/tiny:{nonce}",
    ):
        client.images.remove(name, noprune=False)
    client.close()


@pytest.fixture(scope="session")
def session_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sif-store")


@pytest.fixture(scope="session")
def tiny_sif(tiny_image: TinyImage, session_store: Path) -> Path:
    """The tiny image converted once from the open registry, for tests that only read a .sif."""
    return ensure_sif(tiny_image.open_ref, session_store, nohttps=True)


@dataclass(frozen=True)
class Recorder:
    binary: Path
    log: Path

    def calls(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []


@pytest.fixture
def recorder(tmp_path: Path) -> Recorder:
    """An `apptainer` that logs its calls; point HARBOR_HPC_APPTAINER at `binary`."""
    log = tmp_path / "apptainer-calls.log"
    binary = tmp_path / "apptainer-recorder"
    real = shutil.which("apptainer") or shutil.which("singularity") or "false"
    binary.write_text(RECORDER.format(log=log, real=real))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return Recorder(binary, log)


def write_manifest(path: Path, images: dict[str, ImageRecord]) -> None:
    """A manifest as `build` writes it: `images` keyed by build context, and their tasks."""
    manifest = Manifest(registry="localhost:5000/harbor-hpc-test", tasks_root=str(path.parent))
    for key, image in images.items():
        manifest.set_image(key, image)
    save_manifest(path, manifest)
