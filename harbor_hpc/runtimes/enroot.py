"""enroot as the runtime of a container whose root is our own (containers/holder.py), on nodes
without Apptainer (`runtime`: the setting, else Apptainer where there is one, else enroot).

enroot 4.1 starts a folder (`enroot start NAME`, NAME in ENROOT_DATA_PATH) in a mount namespace of
its own: it mounts what its configuration's fstab files list, runs its hooks, and switches root
into the folder. Our container's root is already mounted, in the holder's namespaces, where the
user is root: enroot runs there as that root (ENROOT_ALLOW_SUPERUSER: no user namespace of its
own), so slirp4netns, the watchdog and the stop see the container as they see Apptainer's. Its
configuration is ours (ENROOT_SYSCONF_PATH, `sysconf`): Docker's /dev (a 64 MB tmpfs with the
usual devices and a pty namespace of its own), the container's own /proc, /sys read-only, and
nothing of the node's. The site's mounts and hooks are for its users' shells and break a task's
Docker view: a tmpfs on /tmp and /run (hiding what the image has there), the node's /dev, $HOME,
the node's user added to /etc/passwd. enroot 4.1 has no process, IPC, UTS or network namespace:
`unshare` makes them before it starts, as Apptainer's --pid --ipc --uts --net do, and the
container's name and loopback are set in them (`NAMESPACES_UP`). What it leaves in the root
(its lock file, /.lock, bound there) the command server hides (apptainer_server.py).
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.runtimes.base import Start

# The container's /dev as Docker makes it (64 MB), the node's device nodes bound in.
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
FSTAB = "\n".join(
    [
        "/proc /proc none x-create=dir,rbind,rw,nosuid,nodev,noexec,rslave 0 -1",
        "/sys /sys none x-create=dir,rbind,ro,nosuid,nodev,noexec,rslave 0 -1",
        "tmpfs /dev tmpfs x-create=dir,rw,nosuid,noexec,mode=755,size=65536k 0 -1",
        *(
            f"/dev/{name} /dev/{name} none x-create=file,bind,rw,nosuid,noexec 0 -1"
            for name in _DEVICES
        ),
        "devpts /dev/pts devpts x-create=dir,rw,nosuid,noexec,newinstance,ptmxmode=0666,"
        "mode=620 0 -1",
        "mqueue /dev/mqueue mqueue x-create=dir,rw,nosuid,nodev,noexec,nofail,silent 0 -1",
        "",
    ]
)
# The links Docker's /dev has; and, for a user without a subuid range (the holder maps root
# alone), apt's download user left out as enroot's own hook does (apt cannot switch to _apt).
HOOK = """#!/bin/sh
set -eu
for link in fd:/proc/self/fd ptmx:pts/ptmx stdin:/proc/self/fd/0 stdout:/proc/self/fd/1 \\
    stderr:/proc/self/fd/2 core:/proc/kcore; do
  ln -sfn "${link#*:}" "${ENROOT_ROOTFS}/dev/${link%%:*}"
done
mkdir -p "${ENROOT_ROOTFS}/dev/shm"
if [ -n "${HARBOR_HPC_ONE_ID-}" ] && [ -f "${ENROOT_ROOTFS}/etc/debian_version" ]; then
  mkdir -p "${ENROOT_ROOTFS}/etc/apt/apt.conf.d"
  printf 'APT::Sandbox::User "root";\\n' > "${ENROOT_ROOTFS}/etc/apt/apt.conf.d/00harbor-hpc"
fi
"""
# Run by the host's python3 in the container's new namespaces, before enroot: the container's
# name (argv[1]) and its loopback up (a new network namespace has it down; Apptainer's and
# Docker's have it up), then enroot. SIOCGIFFLAGS and SIOCSIFFLAGS on "lo", IFF_UP.
NAMESPACES_UP = """import fcntl, os, socket, struct, sys
socket.sethostname(sys.argv[1])
if sys.argv[2] == "net":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
    fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
os.execvp(sys.argv[3], sys.argv[3:])
"""
# What enroot itself needs of the node's environment; nothing else of it reaches the container.
_PASSED = ("PATH", "LANG", "TMPDIR")
# What Apptainer starts a container with (enroot, no login shell, starts it with no variables):
# Docker's default PATH and root's HOME; the image's ENV comes after (the command server's).
_START_ENV = ("HOME=/root", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")


def find_enroot() -> str | None:
    """The enroot binary (`HARBOR_HPC_ENROOT` overrides PATH), or None."""
    return os.environ.get("HARBOR_HPC_ENROOT") or shutil.which("enroot")


def require_enroot() -> str:
    found = find_enroot()
    if found is None:
        raise HarborHpcError(
            "enroot is not on PATH",
            hint="load it (`module load enroot`), or set runtime=apptainer where Apptainer is",
        )
    return found


def sysconf(folder: Path) -> Path:
    """enroot's configuration for one container, in its private `folder` (no other process
    writes there)."""
    target = folder / "enroot-sysconf"
    for name in ("mounts.d", "hooks.d", "environ.d"):
        (target / name).mkdir(parents=True, exist_ok=True)
    (target / "mounts.d" / "10-harbor-hpc.fstab").write_text(FSTAB)
    hook = target / "hooks.d" / "10-harbor-hpc.sh"
    hook.write_text(HOOK)
    hook.chmod(0o755)
    return target


def private_env(sysconf_dir: Path, data: Path) -> list[str]:
    """What enroot runs with (`env -i`): the node's PATH, LANG and TMPDIR, our configuration
    (`sysconf_dir`) and folders (under `data`), so that no site enroot.conf (its runtime and
    data paths, pyxis's) nor the user's own settings change what our containers get."""
    passed = [f"{name}={os.environ[name]}" for name in _PASSED if name in os.environ]
    return [
        *passed,
        "ENROOT_ALLOW_SUPERUSER=y",
        f"ENROOT_SYSCONF_PATH={sysconf_dir}",
        f"ENROOT_CONFIG_PATH={sysconf_dir}/none",
        f"ENROOT_DATA_PATH={data}",
        f"ENROOT_RUNTIME_PATH={data / 'enroot'}",
        f"ENROOT_CACHE_PATH={data / 'enroot'}",
        "ENROOT_ROOTFS_WRITABLE=y",
        "ENROOT_LOGIN_SHELL=n",
    ]


def container_command(
    merged: Path,
    command: Sequence[str],
    *,
    options: Sequence[str],
    own_network: bool,
    subids: bool,
    sysconf_dir: Path,
) -> list[str]:
    """`enroot start` of `command` on the root `merged`, in new process, IPC, UTS (and with
    `own_network`, network) namespaces. `options` are those the environment gives Apptainer
    (holder.bind_targets reads them too): its binds (`-B SOURCE:TARGET[:ro]`), variables
    (`--env`) and name (`--hostname`). A GPU flag is refused: enroot's GPU hooks are not ours."""
    mounts, hostname = [], "localhost"
    env = [arg for value in _START_ENV for arg in ("--env", value)]
    for flag, value in itertools.pairwise(options):
        if flag in {"-B", "--bind"}:
            source, target, *mode = value.split(":")
            access = "ro" if mode == ["ro"] else "rw"
            mounts += ["--mount", f"{source}:{target}:none:x-create=auto,rbind,{access},nosuid"]
        elif flag == "--env":
            env += ["--env", value]
        elif flag == "--hostname":
            hostname = value
    if {"--nv", "--rocm"} & set(options):
        raise HarborHpcError(
            "GPUs are not passed to enroot's containers yet",
            hint="run GPU tasks on nodes with Apptainer (runtime=apptainer)",
        )
    enroot_env = private_env(sysconf_dir, merged.parent)
    if not subids:
        enroot_env.append("HARBOR_HPC_ONE_ID=y")
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts"]
    if own_network:
        unshare.append("--net")
    return [
        *unshare,
        *(sys.executable, "-I", "-S", "-c", NAMESPACES_UP, hostname),
        "net" if own_network else "-",
        *("env", "-i", *enroot_env, require_enroot(), "start", "--rw", *mounts, *env),
        merged.name,
        *command,
    ]


class Enroot:
    """enroot 4.1 as the runtime: on a root of our own only, as the root of its namespaces."""

    name = "enroot"
    own_root_only = True
    as_user = False
    fakes_other_ids = False
    writes_hostname = False

    def command(self, start: Start) -> list[str]:
        return container_command(
            start.image,
            start.command,
            options=start.options,
            own_network=start.own_network,
            subids=start.subids,
            sysconf_dir=sysconf(start.private),
        )
