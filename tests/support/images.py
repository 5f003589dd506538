"""The images the tests build, an `apptainer` that logs its calls, and manifests.

Converting a 200 MB image takes about 20 s here, so the image the store's tests convert is a
2 MB one built from the test base image (a shell and libc only): each conversion takes about a
second, and the session converts it once for every test that only needs a finished .sif. Tests
whose tasks must run convert a 60 MB one (bash, coreutils) instead, in about 7 s. The base
image's .sif and a published task's image are built once per session (tests/conftest.py).
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from harbor_hpc.core.proc import run
from harbor_hpc.runtimes.apptainer import (
    Compression,
    build_command,
    local_apptainer,
    sif_compression,
)
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, save_manifest

TINY_DOCKERFILE = """\
FROM {base} AS base
FROM scratch
COPY --from=base /bin/dash /bin/sh
COPY --from=base /lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libc.so.6
COPY --from=base /lib64/ld-linux-x86-64.so.2 /lib64/ld-linux-x86-64.so.2
LABEL org.harbor-hpc.test={nonce}
"""

# The test image without python3 (`base`), less what no test reads, flattened into one layer.
SLIM_DOCKERFILE = """\
FROM {base} AS full
RUN rm -rf /usr/share/locale /usr/share/doc /usr/share/man /usr/share/info /usr/share/zoneinfo \\
    /usr/lib/x86_64-linux-gnu/gconv /usr/lib/x86_64-linux-gnu/perl-base /usr/share/perl5 \\
    /var/cache/* /var/lib/apt/lists/* /var/log/*
FROM scratch
COPY --from=full / /
"""
SLIM_TAG = "harbor-hpc-test/slim:bookworm"

# A published task's image: a root-owned WORKDIR, ENV, an ENTRYPOINT that edits /etc/hosts
# and leaves a mark, then runs the command it was given (Harbor's `sleep infinity`).
# Its ENTRYPOINT sets up, then (as servers do) works in the background for two seconds before
# it is ready: the environment waits until the container is quiet, however busy the node.
FIDELITY_DOCKERFILE = """\
FROM {base}
RUN mkdir -p /app && chmod 755 /app && echo 'seed' > /app/seed.txt \
    && useradd -m agent && useradd -m checker
WORKDIR /app
ENV LANG=C.UTF-8 GREETING="hello world"
ENTRYPOINT ["/bin/sh", "-c", \
    "echo '10.1.2.3 entry.test' >> /etc/hosts; : > /tmp/entrypoint-ran; \
(timeout 2 sh -c 'while :; do :; done'; : > /tmp/entrypoint-busy-done) & exec \\"$@\\"", "--"]
"""
FIDELITY_TAG = "harbor-hpc-test/fidelity:bookworm"


# A trainer's image for pyxis (`srun --container-image`): Slurm's client and munge's library, to
# queue arrays from inside; what our environment needs to start sandboxes there with enroot
# (squashfuse, fuse-overlayfs, slirp4netns) and enroot's own libraries. The trainer's Python
# and harbor-hpc come from the host (--container-mounts), as a lab's shared venv does.
TRAINER_DOCKERFILE = """\
FROM {base}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    slurm-client libmunge2 squashfuse fuse-overlayfs fuse3 slirp4netns libbsd0 jq gawk \
    && rm -rf /var/lib/apt/lists/*
"""
TRAINER_TAG = "harbor-hpc-test/trainer:bookworm"


def build_trainer_sqsh(sqsh: Path, env: Mapping[str, str]) -> Path:
    """The trainer's image (TRAINER_DOCKERFILE) as enroot's `sqsh`, made as a pyxis user
    makes one: `enroot import` from the local Docker daemon."""
    import docker

    client = docker.from_env()
    dockerfile = TRAINER_DOCKERFILE.format(
        base=env.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    )
    try:
        client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=TRAINER_TAG, rm=True)
    finally:
        client.close()
    made = run(
        ["enroot", "import", "-o", str(sqsh), f"dockerd://{TRAINER_TAG}"], timeout=600, env=env
    )
    assert made.ok, f"enroot import of {TRAINER_TAG}: {made.why()}"
    return sqsh


@cache
@cache
def session_builder() -> tuple[str | None, Compression]:
    """The apptainer (None: this node has none, as on enroot's clusters) and the compression of
    this test process's image builds, asked once, before any test runs (tests/conftest.py):
    tests hide Apptainer from the process (PATH, HARBOR_HPC_APPTAINER, find_apptainer's cache)
    while background builds run."""
    return local_apptainer(), sif_compression()


def build_sif(
    sif: Path, image: str, *, env: Mapping[str, str] | None = None, background: bool = False
) -> Path:
    """`apptainer build` of the local Docker `image` into `sif`, compressed as the store's images
    are, readable by every local user; in the `background`, at the lowest CPU priority. Where
    the node has no Apptainer, `harbor-hpc convert`'s way without it: the image's layers from
    `docker save`, laid out and written as a SIF (containers/store.py)."""
    binary, compression = session_builder()
    if binary is None:
        store = sif.with_name(f"{sif.name}.store")
        convert = [sys.executable, "-c", _CONVERT, f"docker-daemon://{image}", str(store)]
        done = run(["nice", "-n", "19", *convert] if background else convert, timeout=600, env=env)
        assert done.ok, f"converting {image} without Apptainer: {done.why()}"
        os.replace(done.stdout.strip(), sif)
    else:
        build = build_command(
            "-F", str(sif), f"docker-daemon://{image}", binary=binary, compression=compression
        )
        built = run(["nice", "-n", "19", *build] if background else build, timeout=600, env=env)
        assert built.ok, f"apptainer build of {image}: {built.why()}"
    sif.chmod(0o755)
    return sif


# The store's conversion of one image (argv: the source, the store's folder): prints the .sif.
_CONVERT = """\
import sys
from pathlib import Path
from harbor_hpc.containers.store import ensure_sif
print(ensure_sif(sys.argv[1], Path(sys.argv[2])))
"""


def build_debian_sif(sif: Path, env: Mapping[str, str], *, background: bool) -> Path:
    """The test base image (python3 included) as the .sif `sif`."""
    image = env.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    return build_sif(sif, image, env=env, background=background)


def build_fidelity_sif(sif: Path, env: Mapping[str, str], *, background: bool) -> Path:
    """A published task's image (FIDELITY_DOCKERFILE), built by Docker and turned into the .sif
    `sif` as `harbor-hpc convert` does. Kept in Docker under a fixed tag: later sessions find it."""
    import docker

    client = docker.from_env()
    base = env.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    dockerfile = FIDELITY_DOCKERFILE.format(base=base).encode()
    try:
        client.images.build(fileobj=io.BytesIO(dockerfile), tag=FIDELITY_TAG, rm=True)
    finally:
        client.close()
    return build_sif(sif, FIDELITY_TAG, env=env, background=background)


# Stands in for `apptainer`: logs each call's verb, can slow a build down before or after the
# real one (to overlap concurrent converters, or to kill one mid-way), then runs the real binary.
RECORDER = """\
#!/bin/sh
echo "$1" >> {log}
if [ "$1" = build ]; then
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


@dataclass(frozen=True)
class Recorder:
    binary: Path
    log: Path

    def calls(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []


def write_manifest(path: Path, images: dict[str, ImageRecord]) -> None:
    """A manifest as `build` writes it: `images` keyed by build context, and their tasks."""
    manifest = Manifest(registry="localhost:5000/harbor-hpc-test", tasks_root=str(path.parent))
    for key, image in images.items():
        manifest.set_image(key, image)
    save_manifest(path, manifest)


def damage(sif: Path) -> None:
    """Flip one byte in the middle of `sif` and put its time stamps back: the same size and
    mtime, nothing a `stat` could see."""
    before = sif.stat()
    with sif.open("r+b") as handle:
        handle.seek(before.st_size // 2)
        byte = handle.read(1)
        handle.seek(before.st_size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    os.utime(sif, ns=(before.st_atime_ns, before.st_mtime_ns))


# The compressor ids of a squashfs superblock.
SQUASHFS_COMPRESSORS = {1: "gzip", 2: "lzma", 3: "lzo", 4: "xz", 5: "lz4", 6: "zstd"}


def squashfs_compression(sif: Path) -> str:
    """How the squashfs in `sif` is compressed, as its superblock says."""
    with sif.open("rb") as handle:
        head = handle.read(1 << 20)
    start = head.index(b"hsqs")
    return SQUASHFS_COMPRESSORS[int.from_bytes(head[start + 20 : start + 22], "little")]
