"""Finding Apptainer (or Singularity) and the flags that let the current user run images here.

Clusters install Apptainer setuid or rely on unprivileged user namespaces; root on some machines
lacks a capability that the setuid path asks for. Rather than guess, `run_flags` tries a tiny
`exec` of an image once per process and keeps the first flag set that works.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

from harbor_hpc.core.errors import HarborHpcError

BINARIES = ("apptainer", "singularity")


@cache
def find_apptainer() -> str:
    """The Apptainer or Singularity binary on PATH (`HARBOR_HPC_APPTAINER` overrides)."""
    override = os.environ.get("HARBOR_HPC_APPTAINER")
    if override:
        return override
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    raise HarborHpcError(
        "neither apptainer nor singularity is on PATH",
        hint="load it (`module load apptainer`) or install Apptainer; `harbor-hpc doctor` checks",
    )


# Tried in order: what a cluster user normally needs (nothing), then user namespaces
# (unprivileged installs, or root without the full capability set), then fakeroot.
_CANDIDATE_FLAGS: tuple[tuple[str, ...], ...] = ((), ("--userns",), ("--fakeroot",))


@cache
def run_flags(sif: Path, *, fakeroot: bool = False) -> tuple[str, ...]:
    """Flags for `apptainer exec/instance` that work for this user with this image."""
    candidates = [("--fakeroot",)] if fakeroot else list(_CANDIDATE_FLAGS)
    errors = []
    for flags in candidates:
        result = subprocess.run(
            [find_apptainer(), "exec", *flags, str(sif), "/bin/sh", "-c", "true"],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode == 0:
            return flags
        errors.append(f"{' '.join(flags) or '(no flags)'}: {result.stderr.strip()[-300:]}")
    raise HarborHpcError(
        f"apptainer cannot run {sif} here:\n  " + "\n  ".join(errors),
        hint="`harbor-hpc doctor` shows what is missing (user namespaces, subuid, /dev/fuse)",
    )
