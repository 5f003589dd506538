"""One container: an Apptainer process whose main process is our command server.

The server (python3's standard library, or bash where the image has no python3) talks to us over
its stdin/stdout pipes: only this process holds them. Files move through the container's private
staging folder, bind-mounted at /staging. A task's main container and each compose service beside
it (pod.py) are one of these; the environment (environment.py) decides how they are started,
connected and watched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import shutil
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

import psutil

from harbor_hpc.containers.channel import Channel, ChannelClosed, CommandOutput
from harbor_hpc.containers.errors import ContainerDied, ContainerStartFailed
from harbor_hpc.containers.holder import Holder, bind_targets, shm_bind
from harbor_hpc.containers.sif import ImageConfig, root_partition
from harbor_hpc.containers.watchdog import (
    kill_processes,
    process_tree,
    tree_processes,
    wait_gone,
    whole_container,
)
from harbor_hpc.core.templates import template_path
from harbor_hpc.runtimes import RUNTIMES
from harbor_hpc.runtimes.base import Runtime, Start

STAGING = "/staging"
ENV_FILES = f"{STAGING}/env_files"
SERVER_DIR = f"{STAGING}/.hh"
# The image's root file system as it is in the .sif, mounted read-only beside the overlay. The
# server's python3 starts from here: through the overlay (fuse-overlayfs) its first look at its
# standard library's folder costs a FUSE round trip per file there, some 300 ms of a start.
IMAGE_VIEW = f"{SERVER_DIR}/image"
# The image decides which server runs: python3's standard library if it has one (from the image
# view where it is there), else bash.
LAUNCHER = (
    "IFS=:; for dir in $PATH; do "
    f'if [ -x "{IMAGE_VIEW}$dir/python3" ]; then unset IFS; '
    f'exec "{IMAGE_VIEW}$dir/python3" -I -S "$1/server.py" "$2" "$1/env"; fi; done; unset IFS; '
    'if command -v python3 >/dev/null 2>&1; then exec python3 -I -S "$1/server.py" "$2" "$1/env"; '
    'fi; if command -v bash >/dev/null 2>&1; then exec bash "$1/server.sh" "$1" "$2" "$1/env"; fi; '
    'echo "harbor-hpc: the image has neither python3 nor bash to run commands with" >&2; exit 127'
)
# The descriptor the in-container servers keep on each tmpfs mount (see apptainer_server.py).
TMPFS_FDS = (61, 62)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A user name or uid as `useradd` accepts them; anything else (`-c cmd`) never reaches `su`.
_USER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$")
_STDERR_TAIL_LINES = 40
# What a background process (an ENTRYPOINT, a service's command) started in the background is up
# before the trial goes on: the container's processes are waited for until none has run for
# QUIET_SEC (a server blocked in accept), SETTLE_MAX_SEC at most (one that keeps working, say).
QUIET_SEC = 0.15
SETTLE_MAX_SEC = 15.0


def launcher(workdir: str) -> list[str]:
    """The container's command: the command server, started in `workdir`."""
    return ["/bin/sh", "-c", LAUNCHER, "harbor-hpc-server", SERVER_DIR, workdir]


def server_mounts(staging: Path, sif: Path | None) -> list[str]:
    """Apptainer's options mounting what a container's server needs: `staging` at /staging,
    and the image view in it (`staging`/.hh/image is its mount point) where `sif` is a SIF with
    a squashfs root (and a path a bind can name: no `:` or `,`)."""
    options = ["-B", f"{staging}:{STAGING}"]
    partition = None
    if sif is not None and not {":", ","} & set(str(sif)):
        partition = root_partition(sif)
    if partition is not None:
        options += ["-B", f"{sif}:{IMAGE_VIEW}:id={partition.id},image-src=/"]
    return options


def _tree_activity(pid: int) -> tuple[float, frozenset[int], bool]:
    """The CPU time the process tree under `pid` has used, its pids, and whether one of them
    runs or waits for the disk right now."""
    cpu, pids, busy = 0.0, set(), False
    for process in tree_processes(pid):
        with contextlib.suppress(psutil.Error):
            with process.oneshot():
                times = process.cpu_times()
                cpu += times.user + times.system
                busy = busy or process.status() in {psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP}
            pids.add(process.pid)
    return cpu, frozenset(pids), busy


class Container:
    """A started container (`launch`) with its command server, from `sif` and its `image`
    config, in the private folder `private` (its overlay and staging folder). `name` says whose
    it is in messages ("task T", "task T, service S")."""

    def __init__(
        self, name: str, private: Path, sif: Path, image: ImageConfig, logger: logging.Logger
    ) -> None:
        self.name = name
        self.private = private
        self.sif = sif
        # The image unpacked on the node's disk (roots.py), the lower of its own root, if any.
        self.root: Path | None = None
        # Its root, where it is an overlay of our own (holder.py): mounted in `holder`'s
        # namespaces (set before its mounts are asked for: it needs no image view).
        self.holder: Holder | None = None
        self.merged: Path | None = None
        self.image = image
        self.logger = logger
        # What starts it (runtimes.container_runtime): enroot only on a root of our own.
        self.runtime: Runtime = RUNTIMES["apptainer"]
        self.process: asyncio.subprocess.Process | None = None
        self.channel: Channel | None = None
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._stderr_task: asyncio.Task[None] | None = None

    @property
    def staging(self) -> Path:
        return self.private / "staging"

    @property
    def root_state(self) -> Path:
        """Where its own root's upper, work and mount folders are (holder.py)."""
        return self.private / "root"

    @property
    def overlay(self) -> Path:
        return self.private / "overlay"

    def stage(self, env: Mapping[str, str], files: Path | None = None) -> None:
        """Make the overlay and staging folders, the server and its environment (the image's
        ENV, which the server makes its own: Apptainer's start-up would let its LANG=C win
        over the image's, and adds variables Docker does not), and `files` at /staging/env_files."""
        self.overlay.mkdir(parents=True)
        server_dir = self.staging / ".hh"
        for folder in (
            self.staging,
            server_dir,
            server_dir / "req",
            server_dir / "out",
            server_dir / "image",
        ):
            folder.mkdir()
            folder.chmod(0o755)
        (self.staging / "xfer").mkdir(mode=0o777)
        (self.staging / "xfer").chmod(0o777)
        shutil.copy(template_path("apptainer_server.py"), server_dir / "server.py")
        shutil.copy(template_path("apptainer_server.sh"), server_dir / "server.sh")
        (server_dir / "env").write_bytes(
            b"".join(
                f"{name}={value}".encode() + b"\0"
                for name, value in env.items()
                if ENV_NAME.match(name)
            )
        )
        if files is not None and files.is_dir():
            shutil.copytree(files, self.staging / "env_files", symlinks=True)

    @property
    def image_path(self) -> Path:
        """What Apptainer runs: its own root where it has one, else the .sif."""
        return self.merged or self.sif

    async def mount_root(self, options: Sequence[str], above: Sequence[Path] = ()) -> None:
        """Mount the container's root in its holder's namespaces: the image's unpacked root
        (`root`) or its .sif as lower, a snapshot's layers `above` it, with the mount points of
        the binds in `options`."""
        assert self.holder is not None
        self.merged = await self.holder.mount(
            self.root_state, self.sif, self.root, bind_targets(options), above
        )

    def command(
        self,
        flags: Sequence[str],
        workdir: str,
        *,
        own_network: bool,
        options: Sequence[str],
        no_mount: str | None = None,
        net_of: int | None = None,
    ) -> list[str]:
        """The command starting the container's server in `workdir`, as its runtime starts it:
        on the .sif with Apptainer's `flags` (`run_flags`), or in its holder's namespaces (and
        the network namespace of host pid `net_of`), as root there on its own root."""
        start = Start(
            command=launcher(workdir),
            options=options,
            own_network=own_network,
            image=self.image_path,
            own_root=self.holder is not None,
            subids=self.holder.subids if self.holder is not None else False,
            private=self.private,
            flags=flags,
            overlay=self.overlay,
            no_mount=no_mount,
        )
        if self.holder is None:
            return self.runtime.command(start)
        assert self.merged is not None
        return [*self.holder.enter(net_of), *self.runtime.command(start)]

    def mounts(self) -> list[str]:
        """Apptainer's options mounting what this container's server needs (`server_mounts`);
        its own root needs no image view (the kernel's overlay serves its files) and has a
        /dev/shm of Docker's size (holder.py)."""
        if self.holder is not None:
            return [*server_mounts(self.staging, None), *shm_bind(self.root_state)]
        return server_mounts(self.staging, self.sif)

    async def launch(self, command: Sequence[str]) -> None:
        """Start `command` (which runs `launcher`) and wait for the server's greeting."""
        self.logger.debug("starting the container: %s", shlex.join(command))
        self.process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=1 << 20,
        )
        self._stderr_task = asyncio.create_task(self._collect_stderr())
        self.channel = Channel(self.process, self.staging / ".hh")
        try:
            await self.channel.wait_ready()
        except ChannelClosed as exc:
            await self._drain_stderr()
            raise ContainerStartFailed(
                f"{self.name}: the container did not start ({self.sif}):\n{self.stderr_text()}"
            ) from exc
        self.logger.debug(
            "%s ready: %s server, uid %d inside", self.name, self.channel.mode, self.channel.uid
        )

    @property
    def pid(self) -> int | None:
        """The host pid at the root of the container's process tree (while it runs)."""
        return self.process.pid if self.process is not None else None

    def server_pid(self) -> int | None:
        """The host pid of the in-container server: the topmost process of the container that
        holds the server's descriptor on /dev/shm (the bash server's jobs inherit it)."""
        if self.process is None:
            return None
        holders = set()
        for pid in process_tree(self.process.pid):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{TMPFS_FDS[0]}") == "/dev/shm":
                    holders.add(pid)
        for pid in holders:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).ppid() not in holders:
                    return pid
        return None

    def tmpfs_paths(self) -> tuple[str, ...]:
        """Where the host reads the container's tmpfs mounts (/dev/shm, /tmp where it is one):
        the descriptors its server keeps on them (the watchdog counts what they hold)."""
        server = self.server_pid()
        return tuple(f"/proc/{server}/fd/{fd}" for fd in TMPFS_FDS) if server else ()

    @property
    def root_user(self) -> str | None:
        """`root` where the server runs as root in the container, else None (the server's user)."""
        return "root" if self.channel is not None and self.channel.uid == 0 else None

    # -- commands ---------------------------------------------------------------

    def script(
        self, command: str, cwd: str | None, env: Mapping[str, str] | None, user: str | int | None
    ) -> bytes:
        lines = []
        for name, value in (env or {}).items():
            if not ENV_NAME.match(name):
                raise ValueError(f"not an environment variable name: {name!r}")
            lines.append(f"export {name}={shlex.quote(str(value))}")
        if cwd:
            # Without one the script starts where the server does, in the workdir.
            lines.append(f"cd -- {shlex.quote(cwd)} || exit 1")
        switch_to = self._user_to_switch_to(user)
        if switch_to is None:
            lines.append(command)
        else:
            # Like Harbor's own environments: su keeps the exported variables.
            lines.append(f"exec su -s /bin/bash -c {shlex.quote(command)} -- {switch_to}")
        return ("\n".join(lines) + "\n").encode()

    def _user_to_switch_to(self, user: str | int | None) -> str | None:
        """The `su` argument for `user` (default: the image's USER, as Docker), or None when
        the command runs as the server's user."""
        assert self.channel is not None
        if user is None and self.image.user:
            user = self.image.user.split(":", 1)[0]
        if user is None or str(user) in {str(self.channel.uid), os.environ.get("USER", "")}:
            return None
        if not _USER_NAME.match(str(user)):
            raise ValueError(f"{self.name}: {user!r} is not a user name or uid")
        if self.channel.uid != 0:
            # Without (fake)root nobody can change user; the container's user stands in
            # for every user (root included), as it owns everything the task can write.
            return None
        if str(user) in {"0", "root"}:
            return None
        if isinstance(user, int) or str(user).isdigit():
            return f'"$(getent passwd {int(user)} | cut -d: -f1)"'
        return shlex.quote(str(user))

    async def run(
        self,
        script: bytes,
        timeout_sec: int | None = None,
        on_chunk: Callable[[str, bytes], None] | None = None,
    ) -> CommandOutput:
        """Run a `script` (see `script`); ContainerDied when the container is gone."""
        if self.channel is None:
            raise RuntimeError(f"{self.name}: the container is not running")
        try:
            output = await self.channel.run(script, timeout_sec=timeout_sec, on_chunk=on_chunk)
        except ChannelClosed as exc:
            raise ContainerDied(
                f"{self.name}: the container stopped ({exc}):\n{self.stderr_text()}"
            ) from exc
        if output.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return output

    async def checked(self, command: str, what: str) -> None:
        output = await self.run(self.script(command, None, None, self.root_user))
        if output.exit_code != 0:
            text = (output.stderr or output.stdout).decode(errors="replace").strip()
            raise RuntimeError(f"{self.name}: {what} failed ({output.exit_code}): {text[-2000:]}")

    async def start_background(
        self,
        argv: Sequence[str],
        log_name: str,
        *,
        cwd: str | None,
        user: str | int | None,
        env: Mapping[str, str] | None = None,
    ) -> tuple[Path, Path]:
        """Start `argv` in the background, its output into /staging/.hh/LOG_NAME.log and its
        exit status into LOG_NAME.exit once it ends: (the log, the exit file) on the host."""
        hh = f"{SERVER_DIR}/{log_name}"
        await self.run(
            self.script(
                f"({shlex.join(argv)}; echo $? > {hh}.exit) > {hh}.log 2>&1 < /dev/null &",
                cwd,
                env,
                user,
            )
        )
        host = self.staging / ".hh" / log_name
        return host.with_name(f"{log_name}.log"), host.with_name(f"{log_name}.exit")

    async def settle(self) -> None:
        """Wait until the container's processes have run for none of QUIET_SEC: what was
        started in the background is then up (a server waits in accept), however busy the
        node; SETTLE_MAX_SEC at most."""
        if self.process is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_MAX_SEC
        last: tuple[float, frozenset[int]] | None = None
        quiet_since = loop.time()
        while loop.time() < deadline:
            now = await asyncio.to_thread(_tree_activity, self.process.pid)
            if now[:2] != last or now[2]:
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= QUIET_SEC:
                return
            last = now[:2]
            await asyncio.sleep(0.03)
        self.logger.debug("%s: its processes still run; the trial goes on beside them", self.name)

    # -- files ------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _transfer_dir(
        self, *, filled_inside: bool = False
    ) -> AsyncIterator[tuple[Path, str]]:
        """A fresh folder under /staging/xfer: (host path, container path), removed afterwards.

        What the container put there (`filled_inside`) is removed by the container: Apptainer's
        fakeroot command (users without a subuid range) remembers the modes it set by inode,
        and an inode the host freed behind its back comes back as a file that it calls a
        folder (a verifier's `> test-stdout.txt` then fails with "Is a directory")."""
        if self.channel is None:
            raise RuntimeError(f"{self.name}: the container is not running")
        name = uuid.uuid4().hex
        host = self.staging / "xfer" / name
        host.mkdir(mode=0o777)
        host.chmod(0o777)  # the container's user may differ from ours (fakeroot, su)
        inside = f"{STAGING}/xfer/{name}"
        try:
            yield host, inside
        finally:
            if filled_inside and self.channel is not None:
                with contextlib.suppress(RuntimeError, ContainerDied):
                    await self.run(self.script(f"rm -rf -- {inside}", None, None, self.root_user))
            shutil.rmtree(host, ignore_errors=True)

    async def upload_file(self, source: Path, target_path: str) -> None:
        async with self._transfer_dir() as (host, inside):
            # With its mode, as `docker cp` keeps it (the user's umask must not reach it).
            await asyncio.to_thread(shutil.copy, source, host / "file")
            target = shlex.quote(target_path)
            await self.checked(
                f'mkdir -p -- "$(dirname -- {target})" && cp -- {inside}/file {target}',
                f"upload of {source} to {target_path}",
            )

    async def upload_dir(self, source: Path, target_dir: str) -> None:
        async with self._transfer_dir() as (host, inside):
            await asyncio.to_thread(shutil.copytree, source, host / "dir", symlinks=True)
            target = shlex.quote(target_dir)
            await self.checked(
                f"mkdir -p -- {target} && cp -R -- {inside}/dir/. {target}/",
                f"upload of {source} to {target_dir}",
            )

    async def download_file(self, source_path: str, target: Path) -> None:
        async with self._transfer_dir(filled_inside=True) as (host, inside):
            await self.checked(
                f"cp -- {shlex.quote(source_path)} {inside}/file", f"download of {source_path}"
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(_copy_over, str(host / "file"), str(target))

    async def download_dir(self, source_dir: str, target: Path) -> None:
        async with self._transfer_dir(filled_inside=True) as (host, inside):
            await self.checked(
                f"mkdir -p {inside}/dir && cp -R -- {shlex.quote(source_dir)}/. {inside}/dir/",
                f"download of {source_dir}",
            )
            target.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(
                shutil.copytree,
                host / "dir",
                target,
                symlinks=True,
                dirs_exist_ok=True,
                copy_function=_copy_over,
            )

    # -- output and stop ----------------------------------------------------------

    async def _collect_stderr(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line and "gocryptfs not found" not in line:
                self._stderr_tail.append(line)
                self.logger.debug("[%s] %s", self.runtime.name, line)

    async def _drain_stderr(self) -> None:
        if self._stderr_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._stderr_task), timeout=2)

    def stderr_text(self) -> str:
        return "\n".join(self._stderr_tail) or "(apptainer printed nothing)"

    async def stop(self, writable: Sequence[str] = ()) -> None:
        """End the container and everything it started. What the container's other users wrote
        into the host's `writable` folders belongs to the user's subordinate uids there
        (fakeroot): it is handed to the container's root, which is the user on the host."""
        channel, self.channel = self.channel, None
        process, self.process = self.process, None
        # Taken before anything ends: Apptainer's FUSE helpers (squashfuse,
        # fuse-overlayfs) are its children until it exits, orphans after. Off the event
        # loop: a fleet stopping at once would hold it for seconds.
        shared = self.holder.pid if self.holder is not None else None
        tree = (
            [] if process is None else await asyncio.to_thread(whole_container, process.pid, shared)
        )
        if channel is not None and not channel.closed:
            cleanup = "rm -rf /staging/env_files /staging/xfer\n"
            if channel.uid == 0 and writable:
                cleanup += f"chown -R 0:0 -- {shlex.join(writable)} 2>/dev/null\n"
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.run(cleanup.encode(), timeout_sec=20), 25)
        if channel is not None:
            channel.shutdown()
        if process is not None:
            await self._end_process(process, tree)
        if channel is not None:
            await channel.wait_closed(timeout_sec=2)
        if self._stderr_task is not None:
            await self._drain_stderr()
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stderr_task
            self._stderr_task = None

    async def _end_process(
        self, process: asyncio.subprocess.Process, tree: list[psutil.Process]
    ) -> None:
        """SIGKILL whatever is left of the tree once the container's main process ended
        (or did not, within a second), and wait until all of it is gone."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(process.wait(), timeout=1)
        if process.returncode is None:
            tree += tree_processes(process.pid)
        kill_processes(tree)
        await process.wait()
        survivors = await asyncio.to_thread(wait_gone, tree, 5)
        if survivors:
            self.logger.warning(
                "%s: processes of the container outlived SIGKILL: %s",
                self.name,
                ", ".join(str(process.pid) for process in survivors),
            )


def _copy_over(source: str, target: str) -> None:
    """`shutil.copy2`, also over a file that one of the container's other users wrote into a
    folder bound from the host (a task's `[agent] user`'s log, say: it belongs to one of the
    user's subordinate uids, which the user may not write, but may replace in a folder of
    theirs). Harbor downloads its log folders onto themselves. A link there is replaced, never
    written through."""
    if os.path.islink(target) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        os.unlink(target)
    shutil.copy2(source, target)
