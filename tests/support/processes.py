"""What the user's containers left running: the tests' check that a stop stops everything.

Tests run side by side (pytest-xdist), so the user's other containers may be running while one
test checks that its own left nothing: a container is told apart by its image. Apptainer's FUSE
mounts of an image (its root, the overlay on it) name it by a descriptor (/proc/self/fd/N), not
by its path, but hold it open; they run in the container's user namespace, beside its starter.
So does the squashfuse_ll under a root of our own (containers/holder.py), beside the holder's
first process: one whose holder another process's environment holds (its `unshare` has a live
parent other than this test's process) is that environment's, not a leftover.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from harbor_hpc.runtimes.apptainer import FUSE_HELPERS

# Apptainer's process that starts a container and stays its parent (and its FUSE helpers').
# How soon a stopped container's processes are gone: on a loaded machine (a CI run) one was
# still there 10 s after, its command line already empty, as a process's is while it exits.
# One that never ends is still found.
ENDED_WITHIN_S = 30

STARTER = "starter"


def container_processes(sif: Path) -> list[str]:
    """This user's processes of containers of `sif` (naming it or holding it open, and every
    process in their user namespaces), and any FUSE helper of Apptainer's that no starter
    holds (a container's mount left behind), as "PID: command line"."""
    own_namespace = _user_namespace(os.getpid())
    mine = [
        process
        for process in psutil.process_iter(["cmdline", "name", "uids", "ppid", "status"])
        if process.info["uids"]
        and process.info["uids"].real == os.getuid()
        and process.info["status"] != psutil.STATUS_ZOMBIE  # ended: its parent has yet to reap it
    ]
    by_pid = {process.pid: process for process in mine}
    others = {
        process.pid for process in mine if _held_for_another(process, by_pid) or _unpacks(process)
    }
    of_sif = {p.pid for p in mine if p.pid not in others and _names(p, str(sif))}
    namespace_of = {process.pid: _user_namespace(process.pid) for process in mine}
    namespaces = {namespace_of[pid] for pid in of_sif} - {None, own_namespace}
    names = {process.pid: process.info["name"] for process in mine}
    found = []
    for process in mine:
        namespace = namespace_of[process.pid]
        orphan_mount = (
            process.info["name"] in FUSE_HELPERS
            and names.get(process.info["ppid"]) != STARTER
            and not _is_holder(by_pid.get(process.info["ppid"]))
            and namespace != own_namespace  # not a test's own FUSE mount (small_disk.py)
        )
        if process.pid in of_sif or orphan_mount or namespace in namespaces:
            found.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])}")
    return found


def _unpacks(process: psutil.Process) -> bool:
    """Whether `process` unpacks an image into the node's roots (roots.py), in a thread of an
    earlier test's process that outlives it: not a container. An unsquashfs ending has no
    command line left, but its name."""
    cmdline = process.info["cmdline"] or []
    return process.info["name"] == "unsquashfs" or "unsquashfs" in cmdline


def _is_holder(process: psutil.Process | None) -> bool:
    """Whether `process` is a root holder's `unshare` or its first process (holder.py)."""
    return process is not None and "root_holder.py" in " ".join(process.info["cmdline"] or [])


def _held_for_another(process: psutil.Process, by_pid: dict[int, psutil.Process]) -> bool:
    """Whether `process` runs under a root holder whose environment another live process
    holds (the holder's `unshare` has a live parent, not this test's process)."""
    seen = 0
    while process is not None and seen < 8:
        parent = by_pid.get(process.info["ppid"])
        if parent is None:
            return False
        if _is_holder(process) and not _is_holder(parent):  # the `unshare`: its parent
            return parent.pid != os.getpid()
        process, seen = parent, seen + 1
    return False


def _names(process: psutil.Process, path: str) -> bool:
    """Whether `process`'s command line names `path`, or it holds `path` open."""
    if path in " ".join(process.info["cmdline"] or []):
        return True
    try:
        descriptors = os.listdir(f"/proc/{process.pid}/fd")
    except OSError:
        return False
    for descriptor in descriptors:
        try:
            if os.readlink(f"/proc/{process.pid}/fd/{descriptor}") == path:
                return True
        except OSError:
            continue
    return False


def _user_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/user")
    except OSError:
        return None


def processes_naming(*parts: str) -> list[psutil.Process]:
    """This user's live processes whose command line holds each of `parts` (read once, as
    they are listed: one may end at any moment after)."""
    found = []
    for process in psutil.process_iter(["cmdline", "uids", "status"]):
        uids, cmdline = process.info["uids"], " ".join(process.info["cmdline"] or [])
        if (
            uids is not None
            and uids.real == os.getuid()
            and process.info["status"] != psutil.STATUS_ZOMBIE
            and all(p in cmdline for p in parts)
        ):
            found.append(process)
    return found


def left_naming(*parts: str) -> list[str]:
    """`processes_naming(*parts)` as "PID: command line", from what was read as they were
    listed (a process that ends in between is not asked again)."""
    return [
        f"{process.pid}: {' '.join(process.info['cmdline'] or [])}"
        for process in processes_naming(*parts)
    ]


def named(processes: list[psutil.Process]) -> dict[psutil.Process, str]:
    """`processes` by their names, leaving out those that ended before their name was read."""
    names = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            names[process] = process.name()
    return names


def gone_within(seconds: float, still: Callable[[], list[str]]) -> list[str]:
    """What `still()` lists once it lists nothing (then nothing), or after `seconds`: the
    answer of the look that ended the wait, never of one more (the user's other containers,
    other tests', start and end at any moment: one more look can find one ending)."""
    deadline = time.monotonic() + seconds
    while (left := still()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def job_processes(job: str) -> list[psutil.Process]:
    """The processes in Slurm job `job`'s cgroups (proctrack/cgroup: `/job_ID/` in each
    controller's path, ID the job's own for an array element), its containers' included."""
    raw = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%A"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    assert raw.isdigit(), f"squeue knows no job {job}"
    found = []
    for process in psutil.process_iter():
        try:
            with open(f"/proc/{process.pid}/cgroup") as file:
                if f"/job_{raw}/" in file.read():
                    found.append(process)
        except OSError:
            continue
    return found
