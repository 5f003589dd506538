"""What the user's containers left running: the tests' check that a stop stops everything."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from harbor_hpc.apptainer.runtime import FUSE_HELPERS

# Apptainer's FUSE mounts of an image (its root, the overlay on it): their command lines name
# the image by a descriptor (/proc/self/fd/N), not by its path.


def container_processes(sif: Path) -> list[str]:
    """This user's processes of containers of `sif`, and any FUSE helper of Apptainer's, as
    "PID: command line"."""
    found = []
    for process in psutil.process_iter(["cmdline", "name", "uids"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if process.info["uids"].real == os.getuid() and (
            str(sif) in cmdline or process.info["name"] in FUSE_HELPERS
        ):
            found.append(f"{process.pid}: {cmdline}")
    return found


def gone_within(seconds: float, still: Callable[[], list[str]]) -> list[str]:
    """What `still()` lists once it lists nothing, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while still() and time.monotonic() < deadline:
        time.sleep(0.2)
    return still()
