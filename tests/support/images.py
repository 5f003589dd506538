"""A tiny image for the .sif store's tests, an `apptainer` that logs its calls, and manifests.

Converting a 200 MB image takes about 20 s here, so the image the store's tests convert is a
2 MB one built from the test base image (a shell and libc only): each conversion takes about a
second, and the session converts it once for every test that only needs a finished .sif.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
