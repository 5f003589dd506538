"""Where a trial's container is weaker than Docker's, said in the trial's folder.

The environment gives a task what Docker gives it wherever the node allows. Where the node
allows less, the trial still runs (its reward is real), and its folder holds LIMITS_FILE: one
sentence per way its container fell short of Docker's, which `status` shows and the exported
line carries (`environment_limits`), so that a reward that might differ from Docker's is named.
"""

from __future__ import annotations

from pathlib import Path

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_write_json, read_json

LIMITS_FILE = "environment-limits.json"

# Apptainer's words on stderr when --fakeroot finds no /etc/subuid range for the user.
ROOT_MAPPED = "root-mapped namespace"
ONE_ID = (
    "one id in the container (without an /etc/subuid range Apptainer maps root alone and fakes "
    "the rest): files that the task's other users create belong to root"
)
ONE_ID_ENROOT = (
    "one id in the container (without an /etc/subuid range enroot maps root alone and has no "
    "fakeroot command): files cannot be given to the task's other users (chown: Invalid "
    "argument), and useradd fails"
)
IN_MEMORY = (
    "writes in memory: its scratch folder (its writable layer, /tmp) is on a tmpfs, which its "
    "memory_mb does not count"
)
WRITABLE_TMPFS = (
    "writes in memory (--writable-tmpfs: this node's apptainer.conf allows no overlay folder, "
    "`allow container dir = no`): what it writes is bounded by apptainer.conf's `sessiondir max "
    "size` and not counted against its memory_mb"
)
AS_YOU = "runs as you, not as root (fakeroot=false): tasks that need root fail"
# What a command prints when its write was refused for want of room (strerror(ENOSPC)); the
# trial's folder says DISK_FULL when its scratch disk (the container's writable layer, /tmp)
# was then below FULL_BELOW_BYTES free: another user, or a neighbour trial, filled the node's
# disk, and a reward below the full one is not the policy's doing.
ENOSPC_TEXT = b"No space left on device"
FULL_BELOW_BYTES = 16 << 20


def disk_full(where: str, free_bytes: int) -> str:
    return (
        f"its scratch disk was full ({free_bytes >> 20} MB free in {where}) while a command "
        "wrote (No space left on device): a reward below 1 is not the agent's; "
        "`resubmit --failed` runs the attempt again"
    )


DISK_FULL_PREFIX = "its scratch disk was full"


def node_network(problem: str) -> str:
    return (
        f"shares the node's network (its ports, its loopback services), not one of its own: "
        f"{problem}"
    )


def write_limits(trial_dir: Path, limits: list[str]) -> None:
    if limits:
        atomic_write_json(trial_dir / LIMITS_FILE, limits)


def read_limits(trial_dir: Path) -> list[str]:
    """What the trial's environment recorded ([] where it ran as in Docker, or recorded none)."""
    try:
        found = read_json(trial_dir / LIMITS_FILE)
    except HarborHpcError:
        return []
    return [str(limit) for limit in found] if isinstance(found, list) else []
