"""A Harbor environment that runs a task's container with Apptainer, safely and fast.

What it replaces, Harbor's own `harbor.environments.singularity`, installs uvicorn
and FastAPI into the image at start (apt-get update, pip: slow, and impossible on
offline compute nodes) and serves commands on a TCP port without authentication,
which every user on the node can reach because Apptainer shares the host's network.

Here the container's main process is a small command server (python3's standard
library, or bash where the image has no python3) that talks to us over its
stdin/stdout pipes: only this process holds them. Files move through a private
staging folder bind-mounted at /staging, a memory watchdog kills the container
when it outgrows the task's `memory_mb`, and `stop` kills the whole process tree
(Apptainer, its FUSE helpers, the workload and anything it left running).

A task cannot tell it is not in Docker, for a user who is not root on the host: it is
root in the container (a user namespace, `--fakeroot`), writes anywhere in a disk-backed
overlay on the node's scratch space (removed with the trial), has its own /tmp, /dev/shm
and HOME, no network when the task says so, the image's ENTRYPOINT started as Docker
starts it, and the image's ENV, WORKDIR and USER, with nothing of Apptainer in its shell.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import inspect
import ipaddress
import logging
import os
import re
import resource
import shlex
import shutil
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, override

import psutil
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.apptainer import gpus
from harbor_hpc.apptainer.channel import Channel, ChannelClosed, CommandOutput
from harbor_hpc.apptainer.egress import Egress
from harbor_hpc.apptainer.environment_kwargs import accepted_environment_kwargs
from harbor_hpc.apptainer.errors import (
    ContainerDied,
    ContainerStartFailed,
    ImageUnavailable,
    MemoryLimitExceeded,
    SetupScriptFailed,
    UnsupportedTask,
)
from harbor_hpc.apptainer.network import (
    ADMIN_HINT,
    RESOLV_CONF,
    OwnNetwork,
    egress_problem,
    hosts_file,
    own_network_problem,
)
from harbor_hpc.apptainer.probes import install_problem
from harbor_hpc.apptainer.runtime import (
    DEFAULT_NO_MOUNT,
    run_flags,
    task_container_command,
)
from harbor_hpc.apptainer.scratch import PrivateDir
from harbor_hpc.apptainer.sif import ImageConfig, image_config
from harbor_hpc.apptainer.watchdog import (
    MemoryWatchdog,
    kill_processes,
    process_tree,
    tree_processes,
    wait_gone,
    whole_container,
)
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.templates import template_path
from harbor_hpc.tasks.discovery import COMPOSE_FILES

STAGING = "/staging"
ENV_FILES = f"{STAGING}/env_files"
SERVER_DIR = f"{STAGING}/.hh"
# Docker's working directory when the image names none.
DEFAULT_WORKDIR = "/"
# The image decides which server runs: python3's standard library if it has one, else bash.
LAUNCHER = (
    'if command -v python3 >/dev/null 2>&1; then exec python3 -I -S "$1/server.py" "$2" "$1/env"; '
    'fi; if command -v bash >/dev/null 2>&1; then exec bash "$1/server.sh" "$1" "$2" "$1/env"; fi; '
    'echo "harbor-hpc: the image has neither python3 nor bash to run commands with" >&2; exit 127'
)
# The descriptor the in-container servers keep on each tmpfs mount (see apptainer_server.py).
TMPFS_FDS = (61, 62)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A user name or uid as `useradd` accepts them; anything else (`-c cmd`) never reaches `su`.
_USER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$")
_STDERR_TAIL_LINES = 40
# Docker starts the ENTRYPOINT and goes on; so do we, after giving it this long to reach the
# command it was handed (Harbor's `sleep infinity`), which entrypoints `exec` once set up.
ENTRYPOINT_GRACE_SEC = 5.0
# What an entrypoint started in the background (`server &; exec "$@"`) comes up before the
# trial's first command: the container's processes are waited for until none has run for
# ENTRYPOINT_QUIET_SEC (a server blocked in accept), ENTRYPOINT_SETTLE_MAX_SEC at most (one that
# keeps working, say).
ENTRYPOINT_QUIET_SEC = 0.15
ENTRYPOINT_SETTLE_MAX_SEC = 15.0
# The named parameters of Harbor's BaseEnvironment that Harbor fills itself or users may set,
# and the one it still takes (and ignores) through **kwargs.
BASE_KWARGS = frozenset(
    name
    for name in inspect.signature(BaseEnvironment.__init__).parameters
    if name not in {"self", "args", "kwargs"}
) | {"suppress_override_warnings"}


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


def _flag(value: Any) -> bool:
    """A boolean kwarg as `--environment-kwarg k=v` may deliver it (JSON or a plain string)."""
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


@functools.cache
def _allow_open_files() -> None:
    """Raise this process's soft limit of open files to its hard limit, once: each open
    environment holds a dozen descriptors (pipes, pidfds, /proc files), so a trainer's fleet of
    a few hundred outgrows the usual soft limit of 1024 while the hard one allows far more."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# Variables every shell sets for itself: not something setup.sh chose to export.
_SHELL_OWN = {"_", "PWD", "OLDPWD", "SHLVL"}


def exported_by_setup(before: bytes, after: bytes) -> dict[str, str]:
    """Variables that `env -0` shows new or changed in `after` (setup.sh's exports)."""

    def parse(dump: bytes) -> dict[str, str]:
        pairs = (item.decode(errors="replace").partition("=") for item in dump.split(b"\0"))
        return {name: value for name, _, value in pairs if _ENV_NAME.match(name)}

    old, new = parse(before), parse(after)
    return {
        name: value
        for name, value in new.items()
        if name not in _SHELL_OWN and old.get(name) != value
    }


def parse_extra_hosts(text: str | None) -> dict[str, list[str]]:
    """`name:address,...` (docker run --add-host's form; an IPv6 address after the first colon)
    as each name's addresses. Raises ValueError naming an entry that is not one."""
    hosts: dict[str, list[str]] = {}
    for entry in (text or "").split(","):
        if not entry.strip():
            continue
        name, _, address = entry.strip().partition(":")
        try:
            ipaddress.ip_address(address.strip("[]"))
        except ValueError:
            raise ValueError(
                f"extra_hosts entry {entry.strip()!r} is not NAME:ADDRESS (an IPv4 or IPv6 address)"
            ) from None
        hosts.setdefault(name.strip().lower(), []).append(address.strip("[]"))
    return hosts


def environment_capabilities(
    *, mounted: bool, egress: bool | None = None, gpus: bool = True
) -> EnvironmentCapabilities:
    """What a task may ask of our environments: no network is an empty network namespace; an
    allowlist, and a policy per phase, where the container gets a network of its own and
    nftables (`egress`: on this node, by default); GPUs, those Slurm gave the job (gpus.py)."""
    if egress is None:
        egress = egress_problem() is None
    return EnvironmentCapabilities(
        mounted=mounted,
        disable_internet=True,
        dynamic_network_policy=egress,
        # The allowlist with every entry kind Harbor knows (egress_proxy.py reads them all).
        **{
            name: egress
            for name in EnvironmentCapabilities.model_fields
            if name.startswith("network_allowlist")
        },
        gpus=gpus,
    )


class SingularityEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor ships no types
    """Runs a task in an Apptainer container from a .sif or a registry reference.

    Kwargs (`--environment-kwarg k=v`):
        singularity_image_cache_dir: where registry references are converted to .sif
            (the store `harbor-hpc convert` fills; default `$HARBOR_HPC_CACHE` or
            ~/.cache/harbor-hpc/sif).
        singularity_force_pull: convert again even when the .sif is cached.
        singularity_no_mount: comma-separated Apptainer mounts to leave out
            (default "home,tmp,bind-paths"; "" keeps them all).
        workdir: the container's working directory (default: the task's workdir, else
            the image's WORKDIR, else /).
        fakeroot: root inside the container, as in Docker (default on); off runs the
            task as the submitting user, without root.
        nohttps: reach the registry over plain HTTP when converting.
        memory_watchdog: kill the container above the task's memory (default on).
        memory_kill_fraction: the share of `memory_mb` at which it kills (0.95).
        memory_poll_interval_sec: how often it looks whether the tree may have grown
            (0.05; see harbor_hpc/apptainer/watchdog.py).
        scratch_dir: where the private per-trial folder goes (staging and the writable
            overlay; default: $TMPDIR, which Slurm sites point at node-local scratch).
        extra_hosts: `name:address,...` lines for the container's /etc/hosts, as
            `docker run --add-host` (a network allowlist resolves these names so too).
    """

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: TrialPaths,
        task_env_config: EnvironmentConfig,
        logger: logging.Logger | None = None,
        singularity_image_cache_dir: Path | str | None = None,
        singularity_force_pull: bool | str = False,
        singularity_no_mount: str | None = None,
        workdir: str | None = None,
        fakeroot: bool | str = True,
        nohttps: bool | str | None = None,
        memory_watchdog: bool | str = True,
        memory_kill_fraction: float = 0.95,
        memory_poll_interval_sec: float = 0.05,
        scratch_dir: Path | str | None = None,
        extra_hosts: str | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - BASE_KWARGS)
        if unknown:
            raise ContainerStartFailed(
                f"unknown environment kwargs: {', '.join(unknown)}; accepted: "
                + ", ".join(accepted_environment_kwargs(SingularityEnvironment))
            )
        self._cache_dir = (
            Path(singularity_image_cache_dir).expanduser() if singularity_image_cache_dir else None
        )
        self._force_pull = _flag(singularity_force_pull)
        self._no_mount = DEFAULT_NO_MOUNT if singularity_no_mount is None else singularity_no_mount
        self._workdir_kwarg = workdir
        self._fakeroot = _flag(fakeroot)
        self._nohttps = None if nohttps is None else _flag(nohttps)
        self._watchdog_enabled = _flag(memory_watchdog)
        self._kill_fraction = float(memory_kill_fraction)
        if not 0 < self._kill_fraction <= 1:
            raise ValueError(
                f"memory_kill_fraction must be above 0 and at most 1, not {memory_kill_fraction}"
            )
        self._poll_interval = float(memory_poll_interval_sec)
        self._scratch_root = Path(scratch_dir).expanduser() if scratch_dir else None
        self._extra_hosts = parse_extra_hosts(extra_hosts)
        super().__init__(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config,
            logger=logger,
            **kwargs,
        )
        self.workdir = self._workdir_kwarg or self.task_env_config.workdir or DEFAULT_WORKDIR
        self.sif_path: Path | None = None
        self.image = ImageConfig()
        self._scratch: PrivateDir | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._channel: Channel | None = None
        self._watchdog: MemoryWatchdog | None = None
        self._own_network = False
        self._network: OwnNetwork | None = None
        self._egress: Egress | None = None
        self._gpus: list[str] = []
        # The container's name, as Docker names one (the first 12 hex digits of its id).
        self.hostname = uuid.uuid4().hex[:12]
        self._stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self._stderr_task: asyncio.Task[None] | None = None

    @staticmethod
    @override
    def type() -> str:
        return "harbor-hpc-apptainer"

    @classmethod
    @override
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(memory_limit=True)

    @property
    @override
    def capabilities(self) -> EnvironmentCapabilities:
        return environment_capabilities(mounted=True)

    @classmethod
    @override
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        """Before Harbor queues any trial: is there an Apptainer that starts, to run them with?"""
        super().preflight(kwargs)
        problem = install_problem()
        if problem is not None:
            raise SystemExit(problem)

    @override
    def _validate_definition(self) -> None:
        # A missing or unconvertible image is reported by start(), where Harbor records
        # it in the trial's result instead of failing before the trial exists.
        return

    @property
    def process_pid(self) -> int | None:
        """The host pid at the root of the container's process tree (while it runs)."""
        return self._process.pid if self._process is not None else None

    @property
    def _private_dir(self) -> Path | None:
        """The trial's private folder on the host (while the environment runs)."""
        return self._scratch.path if self._scratch is not None else None

    @property
    def staging_host_dir(self) -> Path | None:
        """The host folder mounted at /staging (while the environment runs)."""
        return self._private_dir / "staging" if self._private_dir is not None else None

    # -- the image ----------------------------------------------------------

    async def _resolve_image(self, force: bool) -> Path:
        image = self.task_env_config.docker_image
        if not image:
            raise ImageUnavailable(
                f"task {self.environment_name}: task.toml sets no [environment] docker_image; "
                "set it to a .sif path or a registry reference (harbor-hpc rewrite does this)"
            )
        from harbor_hpc.apptainer.store import checked_sif, ensure_sif, sif_file
        from harbor_hpc.core.config import cache_dir as default_store

        path = sif_file(image, self.environment_dir)
        if path is not None:
            if not path.is_file():
                raise ImageUnavailable(
                    f"task {self.environment_name}: the image {image} does not exist; "
                    "convert the dataset's images first (harbor-hpc convert) or fix docker_image"
                )
            where = path.parent
            # A store's .sif is verified against its recorded sha256 (rebuilt when damaged).
            fetch: Callable[[], Path] = functools.partial(checked_sif, path, nohttps=self._nohttps)
        else:
            where = default_store(self._cache_dir)
            fetch = functools.partial(ensure_sif, image, where, nohttps=self._nohttps, force=force)
        try:
            return await asyncio.to_thread(fetch)
        except HarborHpcError as exc:
            hint = f" ({exc.hint})" if exc.hint else ""
            raise ImageUnavailable(
                f"task {self.environment_name}: the image {image} could not be made ready "
                f"in {where}: {exc.message}{hint}"
            ) from exc

    # -- start ----------------------------------------------------------------

    @override
    async def start(self, force_build: bool) -> None:
        _allow_open_files()
        compose = [name for name in COMPOSE_FILES if (self.environment_dir / name).is_file()]
        if compose:
            raise UnsupportedTask(
                f"task {self.environment_name}: environment/{compose[0]} defines Docker Compose "
                "services, which harbor-hpc's Apptainer environment does not run yet; the task "
                "cannot be run faithfully here"
            )
        self.sif_path = await self._resolve_image(force_build or self._force_pull)
        self.image = image_config(self.sif_path) or ImageConfig()
        if not (self._workdir_kwarg or self.task_env_config.workdir):
            self.workdir = self.image.workdir or DEFAULT_WORKDIR
        try:
            flags = await asyncio.to_thread(run_flags, self.sif_path, fakeroot=self._fakeroot)
        except HarborHpcError as exc:
            raise ContainerStartFailed(
                f"task {self.environment_name}: {exc.message} ({exc.hint})"
            ) from exc
        self._choose_network()
        if self._effective_gpus:
            try:
                self._gpus = gpus.take(self._effective_gpus)
            except RuntimeError as exc:
                raise ContainerStartFailed(f"task {self.environment_name}: {exc}") from exc
        self._prepare_scratch()
        try:
            await self._launch(flags)
            await self._start_entrypoint()
            await self._run_setup_script()
        except BaseException:
            await self.stop(delete=True)
            raise
        await self._upload_environment_dir_after_start()

    def _prepare_scratch(self) -> None:
        # The folder is 0700: other users cannot enter it, whatever is inside.
        if self._scratch_root is not None:
            self._scratch_root.mkdir(parents=True, exist_ok=True)
        self._scratch = PrivateDir("harbor-hpc-env-", self._scratch_root)
        private = self._scratch.path
        (private / "overlay").mkdir()
        (private / "tmp").mkdir()
        # What Docker writes into every container (apt's `_apt` reads them too: 0644).
        files = {"resolv.conf": RESOLV_CONF, "hostname": f"{self.hostname}\n"}
        files["hosts"] = hosts_file(
            self.hostname, own_network=self._own_network, extra=self._extra_hosts
        )
        if not (self._own_network or self._no_network):
            # The node's network, as Docker's host network: the node's names too.
            with contextlib.suppress(OSError):
                files["hosts"] = Path("/etc/hosts").read_text() + files["hosts"]
        for name, text in files.items():
            (private / name).write_text(text)
            (private / name).chmod(0o644)
        staging = private / "staging"
        server_dir = staging / ".hh"
        for folder in (staging, server_dir, server_dir / "req", server_dir / "out"):
            folder.mkdir()
            folder.chmod(0o755)
        (staging / "xfer").mkdir(mode=0o777)
        (staging / "xfer").chmod(0o777)
        shutil.copy(template_path("apptainer_server.py"), server_dir / "server.py")
        shutil.copy(template_path("apptainer_server.sh"), server_dir / "server.sh")
        # The image's ENV, which the server makes its environment (Apptainer's own start-up
        # would let its LANG=C win over the image's, and adds variables Docker does not).
        env = dict(self.image.env)
        if self._gpus and gpus.node_driver() == "--nv":
            # The driver's libraries where --nv binds them, as Docker's runtime installs them.
            env["LD_LIBRARY_PATH"] = ":".join(
                part for part in (env.get("LD_LIBRARY_PATH", ""), gpus.DRIVER_LIBS) if part
            )
        (server_dir / "env").write_bytes(
            b"".join(
                f"{name}={value}".encode() + b"\0"
                for name, value in env.items()
                if _ENV_NAME.match(name)
            )
        )
        env_files = self.environment_dir / "files"
        if env_files.is_dir():
            shutil.copytree(env_files, staging / "env_files", symlinks=True)

    @property
    def _policies(self) -> list[NetworkPolicy]:
        """The policy the container starts with, then those of the trial's phases."""
        return [self._network_policy, *self._phase_network_policies]

    @property
    def _no_network(self) -> bool:
        """No phase may use the network: the container starts without any (only loopback)."""
        return all(policy.network_mode == NetworkMode.NO_NETWORK for policy in self._policies)

    def _choose_network(self) -> None:
        """No network, a network of the container's own (slirp4netns), or else the node's."""
        problem = None if self._no_network else own_network_problem()
        self._own_network = not self._no_network and problem is None
        if problem is not None:
            self.logger.warning(
                "task %s: the container shares the node's network, unlike Docker's own "
                "(ports and the node's loopback services are shared): %s; %s",
                self.environment_name,
                problem,
                ADMIN_HINT,
            )

    def _command(self, flags: tuple[str, ...]) -> list[str]:
        assert self.sif_path is not None and self._private_dir is not None
        binds = ["-B", f"{self._private_dir / 'staging'}:{STAGING}"]
        if not self._fakeroot:
            # Without root the overlay cannot copy the image's root-owned /tmp up: a private
            # folder of the user's stands in for it.
            binds += ["-B", f"{self._private_dir / 'tmp'}:/tmp"]
        names = ["hosts"]
        if self._own_network or self._no_network:
            # A name of its own, as Docker gives every container (not the node's).
            names.append("hostname")
            binds += ["--uts", "--hostname", self.hostname]
        if self._own_network:
            names.append("resolv.conf")
        binds += [
            arg for name in names for arg in ("-B", f"{self._private_dir / name}:/etc/{name}")
        ]
        for mount in self._mounts:
            if mount.get("type", "bind") == "bind" and mount.get("source") and mount.get("target"):
                # A missing source becomes a folder, as Docker makes it (Harbor 0.26 mounts a
                # trial's artifacts folder before anything is in it).
                Path(mount["source"]).mkdir(parents=True, exist_ok=True)
                mode = ":ro" if mount.get("read_only") else ""
                binds += ["-B", f"{mount['source']}:{mount['target']}{mode}"]
        if self._gpus:
            binds += gpus.container_options(self._gpus)
        return task_container_command(
            self.sif_path,
            flags,
            ["/bin/sh", "-c", LAUNCHER, "harbor-hpc-server", SERVER_DIR, self.workdir],
            overlay=self._private_dir / "overlay",
            own_network=self._no_network or self._own_network,
            no_mount=self._no_mount,
            options=["--env", f"HARBOR_STAGING={ENV_FILES}", *binds],
        )

    async def _launch(self, flags: tuple[str, ...]) -> None:
        assert self._private_dir is not None
        command = self._command(flags)
        self.logger.debug("starting the container: %s", shlex.join(command))
        self._process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=1 << 20,
        )
        self._stderr_task = asyncio.create_task(self._collect_stderr())
        self._channel = Channel(self._process, self._private_dir / "staging" / ".hh")
        try:
            await self._channel.wait_ready()
        except ChannelClosed as exc:
            await self._drain_stderr()
            raise ContainerStartFailed(
                f"task {self.environment_name}: the container did not start "
                f"({self.sif_path}):\n{self._stderr_text()}"
            ) from exc
        self.logger.debug(
            "container ready: %s server, uid %d inside", self._channel.mode, self._channel.uid
        )
        server = self._server_pid()
        if self._own_network:
            if server is None:
                raise ContainerStartFailed(
                    f"task {self.environment_name}: no server process in the container to "
                    "connect its network to"
                )
            try:
                self._network = await OwnNetwork.attach(server)
                self._egress = Egress(
                    server, self._extra_hosts, lambda line: self.logger.info("[egress] %s", line)
                )
                if any(p.network_mode != NetworkMode.PUBLIC for p in self._policies):
                    await self._egress.apply(self._network_policy)
            except RuntimeError as exc:
                raise ContainerStartFailed(f"task {self.environment_name}: {exc}") from exc
        memory_mb = self._effective_memory_mb
        if self._watchdog_enabled and memory_mb:
            if server is None:
                self.logger.debug("no server descriptors on the tmpfs mounts: not counted")
            self._watchdog = MemoryWatchdog(
                self._process.pid,
                limit_bytes=memory_mb * 1024 * 1024,
                kill_fraction=self._kill_fraction,
                interval_sec=self._poll_interval,
                tmpfs_paths=tuple(f"/proc/{server}/fd/{fd}" for fd in TMPFS_FDS if server),
            )
            self._watchdog.start()

    @override
    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        """A phase's policy (Harbor switches between agent and verifier, a trainer as it
        likes): wherever the container has a network of its own (capabilities say so)."""
        if self._egress is None:
            raise RuntimeError(
                f"task {self.environment_name}: the container has no network of its own to "
                f"apply the {network_policy.network_mode.value} network policy to"
            )
        await self._egress.apply(network_policy)

    def _server_pid(self) -> int | None:
        """The host pid of the in-container server: the topmost process of the container that
        holds the server's descriptor on /dev/shm (the bash server's jobs inherit it)."""
        assert self._process is not None
        holders = set()
        for pid in process_tree(self._process.pid):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{TMPFS_FDS[0]}") == "/dev/shm":
                    holders.add(pid)
        for pid in holders:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).ppid() not in holders:
                    return pid
        return None

    async def _start_entrypoint(self) -> None:
        """Start the image's ENTRYPOINT as Docker does under Harbor, which replaces CMD with
        `sh -c "sleep infinity"`: in the background, as the image's user, and go on once it
        ran that command (entrypoints set things up, then `exec "$@"`) and what it started in
        the background is up (`_settle`), or it ended, or had ENTRYPOINT_GRACE_SEC."""
        if not self.image.entrypoint:
            return
        staging = self.staging_host_dir
        assert staging is not None
        ready, ended = staging / ".hh" / "entrypoint.ready", staging / ".hh" / "entrypoint.exit"
        command = shlex.join(
            [
                *self.image.entrypoint,
                "sh",
                "-c",
                f": > {SERVER_DIR}/entrypoint.ready; exec sleep infinity",
            ]
        )
        await self.exec(
            f"({command}; echo $? > {SERVER_DIR}/entrypoint.exit) "
            f"> {SERVER_DIR}/entrypoint.log 2>&1 < /dev/null &",
            cwd=self.workdir,
        )
        deadline = asyncio.get_running_loop().time() + ENTRYPOINT_GRACE_SEC
        while not (ready.exists() or ended.exists()):
            if asyncio.get_running_loop().time() > deadline:
                self.logger.debug("the ENTRYPOINT still runs; the trial goes on beside it")
                return
            await asyncio.sleep(0.02)
        if ready.exists():
            await self._settle()
        elif ended.exists():
            log = (staging / ".hh" / "entrypoint.log").read_text(errors="replace")[-2000:]
            self.logger.warning(
                "the image's ENTRYPOINT exited with %s before reaching its command:\n%s",
                ended.read_text().strip(),
                log,
            )

    async def _settle(self) -> None:
        """Wait until the container's processes have run for none of ENTRYPOINT_QUIET_SEC:
        what the ENTRYPOINT started in the background is then up (a server waits in accept),
        however busy the node; ENTRYPOINT_SETTLE_MAX_SEC at most."""
        assert self._process is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ENTRYPOINT_SETTLE_MAX_SEC
        last: tuple[float, frozenset[int]] | None = None
        quiet_since = loop.time()
        while loop.time() < deadline:
            now = await asyncio.to_thread(_tree_activity, self._process.pid)
            if now[:2] != last or now[2]:
                quiet_since = loop.time()
            elif loop.time() - quiet_since >= ENTRYPOINT_QUIET_SEC:
                return
            last = now[:2]
            await asyncio.sleep(0.03)
        self.logger.debug("the ENTRYPOINT's processes still run; the trial goes on beside them")

    async def _collect_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        async for raw in self._process.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line and "gocryptfs not found" not in line:
                self._stderr_tail.append(line)
                self.logger.debug("[apptainer] %s", line)

    async def _drain_stderr(self) -> None:
        if self._stderr_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._stderr_task), timeout=2)

    def _stderr_text(self) -> str:
        return "\n".join(self._stderr_tail) or "(apptainer printed nothing)"

    async def _run_setup_script(self) -> None:
        """Source environment/files/setup.sh once, as Harbor's bootstrap does, and keep what
        it exports (a PATH to a venv, say) for every later command."""
        staging = self.staging_host_dir
        if staging is None or not (staging / "env_files" / "setup.sh").is_file():
            return
        before, after = f"{STAGING}/.hh/env.before", f"{STAGING}/.hh/env.after"
        result = await self.exec(
            f"env -0 > {before}; . {ENV_FILES}/setup.sh; status=$?; env -0 > {after}; exit $status",
            user=self._container_root(),
        )
        if result.return_code != 0:
            output = "\n".join(part for part in (result.stdout, result.stderr) if part).strip()
            raise SetupScriptFailed(
                f"task {self.environment_name}: environment/files/setup.sh exited with "
                f"{result.return_code}:\n{output[-4000:]}"
            )
        self._persistent_env.update(
            exported_by_setup(
                (staging / ".hh" / "env.before").read_bytes(),
                (staging / ".hh" / "env.after").read_bytes(),
            )
        )

    def _container_root(self) -> str | None:
        return "root" if self._channel is not None and self._channel.uid == 0 else None

    # -- exec -----------------------------------------------------------------

    def _script(
        self, command: str, cwd: str | None, env: dict[str, str] | None, user: str | int | None
    ) -> bytes:
        lines = []
        for name, value in (env or {}).items():
            if not _ENV_NAME.match(name):
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
        assert self._channel is not None
        if user is None and self.image.user:
            user = self.image.user.split(":", 1)[0]
        if user is None or str(user) in {str(self._channel.uid), os.environ.get("USER", "")}:
            return None
        if not _USER_NAME.match(str(user)):
            raise ValueError(f"task {self.environment_name}: {user!r} is not a user name or uid")
        if self._channel.uid != 0:
            # Without (fake)root nobody can change user; the container's user stands in
            # for every user (root included), as it owns everything the task can write.
            return None
        if str(user) in {"0", "root"}:
            return None
        if isinstance(user, int) or str(user).isdigit():
            return f'"$(getent passwd {int(user)} | cut -d: -f1)"'
        return shlex.quote(str(user))

    @override
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        channel = self._require_channel()
        script = self._script(command, cwd, self._merge_env(env), self._resolve_user(user))
        callback = self._output_callback()
        try:
            if callback is None:
                output = await channel.run(script, timeout_sec=timeout_sec)
            else:
                output = await self._run_streaming(channel, script, timeout_sec, callback)
        except ChannelClosed as exc:
            self._raise_if_memory_breached()
            raise ContainerDied(
                f"task {self.environment_name}: the container stopped ({exc}):\n"
                f"{self._stderr_text()}"
            ) from exc
        if output.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(
            stdout=output.stdout.decode(errors="replace"),
            stderr=output.stderr.decode(errors="replace"),
            return_code=output.exit_code,
        )

    async def _run_streaming(
        self, channel: Channel, script: bytes, timeout_sec: int | None, callback: Any
    ) -> CommandOutput:
        queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
        decoders = {
            stream: codecs.getincrementaldecoder("utf-8")(errors="replace")
            for stream in ("stdout", "stderr")
        }

        async def pump() -> None:
            while (item := await queue.get()) is not None:
                stream, data = item
                text = decoders[stream].decode(data)
                if text:
                    await callback(text, stream)

        pumping = asyncio.create_task(pump())
        try:
            return await channel.run(
                script,
                timeout_sec=timeout_sec,
                on_chunk=lambda stream, data: queue.put_nowait((stream, data)),
            )
        finally:
            queue.put_nowait(None)
            await pumping

    def _require_channel(self) -> Channel:
        self._raise_if_memory_breached()
        if self._channel is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        return self._channel

    def _raise_if_memory_breached(self) -> None:
        if self._watchdog is not None and self._watchdog.breach is not None:
            raise MemoryLimitExceeded(
                f"task {self.environment_name}: {self._watchdog.breach.describe()}"
            )

    async def _checked(self, command: str, what: str) -> None:
        result = await self.exec(command, user=self._container_root())
        if result.return_code != 0:
            raise RuntimeError(
                f"task {self.environment_name}: {what} failed ({result.return_code}): "
                f"{(result.stderr or result.stdout or '').strip()[-2000:]}"
            )

    # -- files ------------------------------------------------------------------

    @contextlib.contextmanager
    def _transfer_dir(self) -> Any:
        """A fresh folder under /staging/xfer: (host path, container path), removed afterwards."""
        staging = self.staging_host_dir
        if staging is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        name = uuid.uuid4().hex
        host = staging / "xfer" / name
        host.mkdir(mode=0o777)
        host.chmod(0o777)  # the container's user may differ from ours (fakeroot, su)
        try:
            yield host, f"{STAGING}/xfer/{name}"
        finally:
            shutil.rmtree(host, ignore_errors=True)

    @override
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        with self._transfer_dir() as (host, inside):
            # With its mode, as `docker cp` keeps it (the user's umask must not reach it).
            await asyncio.to_thread(shutil.copy, source, host / "file")
            target = shlex.quote(target_path)
            await self._checked(
                f'mkdir -p -- "$(dirname -- {target})" && cp -- {inside}/file {target}',
                f"upload of {source} to {target_path}",
            )

    @override
    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        source = Path(source_dir)
        with self._transfer_dir() as (host, inside):
            await asyncio.to_thread(shutil.copytree, source, host / "dir", symlinks=True)
            target = shlex.quote(target_dir)
            await self._checked(
                f"mkdir -p -- {target} && cp -R -- {inside}/dir/. {target}/",
                f"upload of {source} to {target_dir}",
            )

    @override
    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        target = Path(target_path)
        with self._transfer_dir() as (host, inside):
            await self._checked(
                f"cp -- {shlex.quote(source_path)} {inside}/file",
                f"download of {source_path}",
            )
            target.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(shutil.move, host / "file", target)

    @override
    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        target = Path(target_dir)
        with self._transfer_dir() as (host, inside):
            await self._checked(
                f"mkdir -p {inside}/dir && cp -R -- {shlex.quote(source_dir)}/. {inside}/dir/",
                f"download of {source_dir}",
            )
            target.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(
                shutil.copytree, host / "dir", target, symlinks=True, dirs_exist_ok=True
            )

    # -- stop -------------------------------------------------------------------

    @override
    async def stop(self, delete: bool) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        channel, self._channel = self._channel, None
        process, self._process = self._process, None
        # Taken before anything ends: Apptainer's FUSE helpers (squashfuse,
        # fuse-overlayfs) are its children until it exits, orphans after. Off the event
        # loop: a fleet stopping at once would hold it for seconds.
        tree = [] if process is None else await asyncio.to_thread(whole_container, process.pid)
        if channel is not None and not channel.closed:
            # What the container's other users wrote into the host's folders belongs to the
            # user's subordinate uids there (fakeroot): hand it to the container's root, which
            # is the user on the host, and clear the staging folder from inside.
            writable = shlex.join(self._mount_targets(writable_only=True))
            cleanup = "rm -rf /staging/env_files /staging/xfer\n"
            if channel.uid == 0 and writable:
                cleanup += f"chown -R 0:0 -- {writable} 2>/dev/null\n"
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.run(cleanup.encode(), timeout_sec=20), 25)
        if channel is not None:
            channel.shutdown()
        if process is not None:
            await self._end_process(process, tree)
        if self._egress is not None:
            await self._egress.close()
            self._egress = None
        if self._network is not None:
            await self._network.close()
            self._network = None
        if channel is not None:
            await channel.wait_closed(timeout_sec=2)
        if self._stderr_task is not None:
            await self._drain_stderr()
            self._stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._stderr_task
            self._stderr_task = None
        gpus.give_back(self._gpus)
        self._gpus = []
        if self._scratch is not None:
            if not await asyncio.to_thread(self._scratch.remove):
                self.logger.warning("could not remove all of %s", self._scratch.path)
            self._scratch = None
        # The .sif stays: it is the shared cache, whatever `delete` says.

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
                "processes of the container outlived SIGKILL: %s",
                ", ".join(str(process.pid) for process in survivors),
            )
