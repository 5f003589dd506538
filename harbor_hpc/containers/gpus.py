"""GPUs for task containers: the devices Slurm gave this process, each to one container.

A task asks for `gpus` (and `gpu_types`, which `submit` turns into the Slurm request of its
array element). On the node, Slurm names the devices it gave the job in CUDA_VISIBLE_DEVICES
(NVIDIA), ROCR_VISIBLE_DEVICES (AMD) or SLURM_JOB_GPUS; an element running several trials at
once shares them out here, so each container gets its own and sees only those. The container
gets the node's driver as Apptainer binds it (`--nv`, `--rocm`, by what the node has) and the
visible-devices variables narrowed to its share; a task asking for none gets no GPU at all
(`--contain` leaves GPUs out of its /dev).
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from pathlib import Path

from harbor_hpc.core.proc import run
from harbor_hpc.runtimes.apptainer import find_apptainer

# Where Slurm (and CUDA/ROCm launchers) say which devices a process may use, most specific first.
VISIBLE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "SLURM_JOB_GPUS")
# Where `--nv` binds the driver's libraries in the container (Apptainer's own folder).
DRIVER_LIBS = "/.singularity.d/libs"

_lock = threading.Lock()
_taken: set[str] = set()


def node_driver() -> str | None:
    """The Apptainer flag that gives a container this node's GPU driver, or None."""
    if Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi"):
        return "--nv"
    if Path("/dev/kfd").exists():
        return "--rocm"
    return None


@functools.cache
def driver_files(driver: str) -> list[str]:
    """Where Apptainer's `driver` flag (--nv, --rocm) binds the driver's tools and files in a
    container: each binary its nvliblist.conf (rocmliblist.conf) names that this node has, at
    /usr/bin/NAME, and each absolute path there that exists. Mount points a --writable root
    must have (holder.py); its libraries go to DRIVER_LIBS, which every image has."""
    listed = "nvliblist.conf" if driver == "--nv" else "rocmliblist.conf"
    ran = run([find_apptainer(), "buildcfg", "SYSCONFDIR"], timeout=30)
    conf = Path(ran.stdout.strip() or "/etc") / "apptainer" / listed
    try:
        lines = conf.read_text().splitlines()
    except OSError:
        return []
    files = []
    for line in (raw.strip() for raw in lines):
        if not line or line.startswith("#") or ".so" in line:
            continue
        if line.startswith("/"):
            files += [line] if os.path.exists(line) else []
        elif shutil.which(line):
            files.append(f"/usr/bin/{line}")
    return files


def given_devices() -> tuple[str, list[str]]:
    """The variable that names this process's GPUs, and the devices it names (none: '')."""
    for name in VISIBLE_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value and value != "NoDevFiles":
            return name, [device for device in value.split(",") if device]
    return "", []


def take(count: int) -> list[str]:
    """`count` of this process's GPUs that no other container of it holds. Raises
    RuntimeError saying what the process was given and what is in use."""
    variable, devices = given_devices()
    with _lock:
        free = [device for device in devices if device not in _taken]
        if len(free) < count:
            given = f"{variable}={','.join(devices)}" if devices else "none"
            raise RuntimeError(
                f"the task asks for {count} GPU(s); this process was given {given}, "
                f"{len(devices) - len(free)} of them in use by its other containers "
                "(harbor-hpc submit asks Slurm for a task's GPUs; elsewhere run it where "
                "Slurm gave the job GPUs)"
            )
        mine = free[:count]
        _taken.update(mine)
    return mine


def give_back(devices: list[str]) -> None:
    with _lock:
        _taken.difference_update(devices)


def container_options(devices: list[str]) -> list[str]:
    """The flags and variables that give a container `devices` and nothing more."""
    variable, _ = given_devices()
    driver = node_driver()
    names = {"ROCR_VISIBLE_DEVICES"} if driver == "--rocm" else {"CUDA_VISIBLE_DEVICES"}
    if variable != "SLURM_JOB_GPUS":
        names.add(variable)
    options = [driver] if driver else []
    for name in sorted(names - {""}):
        options += ["--env", f"{name}={','.join(devices)}"]
    return options
