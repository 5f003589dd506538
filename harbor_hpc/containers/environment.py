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
import errno
import functools
import inspect
import ipaddress
import logging
import os
import resource
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, override

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.containers import gpus
from harbor_hpc.containers.branch import write_branch
from harbor_hpc.containers.channel import CommandOutput
from harbor_hpc.containers.container import (
    ENV_FILES,
    ENV_NAME,
    SERVER_DIR,
    STAGING,
    Container,
)
from harbor_hpc.containers.egress import Egress
from harbor_hpc.containers.environment_kwargs import accepted_environment_kwargs
from harbor_hpc.containers.errors import (
    ContainerStartFailed,
    ImageUnavailable,
    MemoryLimitExceededError,
    SetupScriptFailed,
    SnapshotRefused,
    UnsupportedTask,
)
from harbor_hpc.containers.holder import Holder, HolderFailed, give_up, root_path
from harbor_hpc.containers.limits import (
    AS_YOU,
    DISK_FULL_PREFIX,
    ENOSPC_TEXT,
    FULL_BELOW_BYTES,
    IN_MEMORY,
    ONE_ID,
    ONE_ID_ENROOT,
    ROOT_MAPPED,
    WRITABLE_TMPFS,
    disk_full,
    node_network,
    write_limits,
)
from harbor_hpc.containers.network import (
    NETNS_HINT,
    RESOLV_CONF,
    OwnNetwork,
    egress_problem,
    hosts_file,
    netns_problem,
    network_hint,
    own_network_problem,
)
from harbor_hpc.containers.options import SingularityOptions
from harbor_hpc.containers.pod import Sidecar, service_sif
from harbor_hpc.containers.probes import install_problem, missing_subid_ranges, ran_out
from harbor_hpc.containers.roots import Lease, UnpackedRoots
from harbor_hpc.containers.sif import ImageConfig, foreign_architecture, image_config
from harbor_hpc.containers.snapshot import (
    Restorable,
    Snapshot,
    branch_record,
    copy_upper,
    fork_trial,
    live_snapshot,
    started_all,
    stopped,
)
from harbor_hpc.containers.watchdog import (
    DiskKill,
    DiskWatchdog,
    MemoryWatchdog,
    OomKill,
    memory_limit_mb,
    oom_kills,
)
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import filesystem_type
from harbor_hpc.core.scratch import PrivateDir
from harbor_hpc.runtimes import container_runtime
from harbor_hpc.runtimes.apptainer import (
    DEFAULT_NO_MOUNT,
    OVERLAY_OFF,
    OVERLAY_OFF_FIX,
    PATH_REFUSED,
    SANDBOX_REFUSED,
    refuses_overlay_folders,
    run_flags,
    writes_in_memory,
)
from harbor_hpc.tasks.compose import MAIN, Compose, UnsupportedCompose, Volume, load_compose

# Docker's working directory when the image names none.
DEFAULT_WORKDIR = "/"
# Docker starts the ENTRYPOINT and goes on; so do we, after giving it this long to reach the
# command it was handed (Harbor's `sleep infinity`), which entrypoints `exec` once set up.
ENTRYPOINT_GRACE_SEC = 5.0
# The named parameters of Harbor's BaseEnvironment that Harbor fills itself or users may set,
# and the one it still takes (and ignores) through **kwargs.
BASE_KWARGS = frozenset(
    name
    for name in inspect.signature(BaseEnvironment.__init__).parameters
    if name not in {"self", "args", "kwargs"}
) | {"suppress_override_warnings"}
# Our typed options (Harbor's base takes auto_mounting among them).
SINGULARITY_OPTIONS = frozenset(SingularityOptions.model_fields)


@functools.cache
def _raise_soft_limits() -> None:
    """Raise this process's soft limits of open files and of processes to their hard limits:
    each open environment holds some nine descriptors (pipes, pidfds, /proc files) and its
    container some 25 processes and threads, so a trainer's fleet of a few hundred outgrows the
    usual soft limits (1024 files, say) while the hard ones allow far more."""
    for limit in (resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC):
        soft, hard = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(limit, (hard, hard))


# Variables every shell sets for itself: not something setup.sh chose to export.
_SHELL_OWN = {"_", "PWD", "OLDPWD", "SHLVL"}
# The agent's and verifier's logs are searched for ENOSPC's words up to this size each
# (terminus-2's, its trajectory included, are a few MB).
_LOG_SCAN_BYTES = 64 << 20


def exported_by_setup(before: bytes, after: bytes) -> dict[str, str]:
    """Variables that `env -0` shows new or changed in `after` (setup.sh's exports)."""

    def parse(dump: bytes) -> dict[str, str]:
        pairs = (item.decode(errors="replace").partition("=") for item in dump.split(b"\0"))
        return {name: value for name, _, value in pairs if ENV_NAME.match(name)}

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
    *, mounted: bool, egress: bool | None = None, netns: bool | None = None, gpus: bool = True
) -> EnvironmentCapabilities:
    """What a task may ask of our environments: no network, where the user may make a network
    namespace (`netns`: on this node, by default); an allowlist, and a policy per phase, where
    the container gets a network of its own and nftables (`egress`: on this node, by default);
    GPUs, those Slurm gave the job (gpus.py); compose services, as one pod (pod.py)."""
    if egress is None:
        egress = egress_problem() is None
    if netns is None:
        netns = netns_problem() is None
    return EnvironmentCapabilities(
        mounted=mounted,
        disable_internet=netns,
        dynamic_network_policy=egress,
        # The allowlist with every entry kind Harbor knows (egress_proxy.py reads them all).
        **{
            name: egress
            for name in EnvironmentCapabilities.model_fields
            if name.startswith("network_allowlist")
        },
        gpus=gpus,
        docker_compose=True,
    )


def _logs_say(folders: list[Path], words: tuple[bytes, ...]) -> set[bytes]:
    """Which of `words` a file under `folders` (the trial's agent and verifier logs, bounded in
    size) holds, read in chunks."""
    overlap = max(len(word) for word in words) - 1
    found: set[bytes] = set()
    for folder in folders:
        for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
            with contextlib.suppress(OSError):
                if not path.is_file() or path.stat().st_size > _LOG_SCAN_BYTES:
                    continue
                with path.open("rb") as file:
                    tail = b""
                    while chunk := file.read(1 << 20):
                        found.update(word for word in words if word in tail + chunk)
                        tail = chunk[-overlap:]
    return found


def _exec_result(output: CommandOutput) -> ExecResult:
    return ExecResult(
        stdout=output.stdout.decode(errors="replace"),
        stderr=output.stderr.decode(errors="replace"),
        return_code=output.exit_code,
    )


def container_hostname() -> str:
    """The container's name, as Docker names one: the first 12 hex digits of a random id, drawn
    again while they are all decimal digits (moby's stringid does so: a resolver reads such a
    name as an address, and `getent hosts $(hostname)` finds nothing; 1 in 280 draws)."""
    while (name := uuid.uuid4().hex[:12]).isdigit():
        pass
    return name


class SingularityEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor ships no types
    """Runs a task in an Apptainer container from a .sif or a registry reference, and a
    compose task's services beside it as one pod (pod.py).

    Kwargs (`--environment-kwarg k=v`): `SingularityOptions`, Harbor's typed options
    (`harbor environment schema harbor_hpc.environment:SingularityEnvironment`).
    """

    options_model: ClassVar[type[EnvironmentOptions] | None] = SingularityOptions

    def __init__(
        self,
        environment_dir: Path,
        environment_name: str,
        session_id: str,
        trial_paths: TrialPaths,
        task_env_config: EnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        # What a fork's children are made with (`restore`), a session and trial of their own.
        self._made_with: dict[str, Any] = {
            "environment_dir": environment_dir,
            "environment_name": environment_name,
            "task_env_config": task_env_config,
            "logger": logger,
            **{k: v for k, v in kwargs.items() if k != "restore_from"},
        }
        # Harbor's own arguments go to its base; the rest are our options, typed.
        harbors = {k: v for k, v in kwargs.items() if k in BASE_KWARGS - SINGULARITY_OPTIONS}
        try:
            self.options = self.parse_options({k: v for k, v in kwargs.items() if k not in harbors})
        except ValueError as exc:
            raise ContainerStartFailed(
                f"{exc}\naccepted: {', '.join(accepted_environment_kwargs(type(self)))}"
            ) from None
        options = self.options
        assert isinstance(options, SingularityOptions)
        cache = options.singularity_image_cache_dir
        self._cache_dir = cache.expanduser() if cache else None
        self._force_pull = options.singularity_force_pull
        no_mount = options.singularity_no_mount
        self._no_mount = DEFAULT_NO_MOUNT if no_mount is None else no_mount
        self._workdir_kwarg = options.workdir
        self._fakeroot = options.fakeroot
        self._runtime_setting = options.runtime
        self._nohttps = options.nohttps
        self._watchdog_enabled = options.memory_watchdog
        self._kill_fraction = options.memory_kill_fraction
        self._poll_interval = options.memory_poll_interval_sec
        self._scratch_root = options.scratch_dir.expanduser() if options.scratch_dir else None
        self._extra_hosts = parse_extra_hosts(options.extra_hosts)
        # The images unpacked on the node: the lower folders of containers' own roots (their
        # owners kept by the user's subuid range: without one, none).
        self._roots = (
            None
            if missing_subid_ranges()
            else UnpackedRoots.on_node(self._scratch_root, options.unpacked_roots)
        )
        self._root_leases: list[Lease] = []
        # The snapshot its root starts from (`restore_from`), held while the root is mounted.
        self._restore_from = options.restore_from
        self._restored: Snapshot | None = None
        # Where it branched (`branch_record`), once started from a snapshot.
        self.branch: dict[str, Any] | None = None
        self._snapshot_cap = (
            options.snapshot_storage_mb * 1024 * 1024 if options.snapshot_storage_mb else None
        )
        # Why its root is not one of our own (Apptainer's own overlay), where it is not.
        self._root_fallback: str | None = None
        # The namespaces the containers' own roots are mounted in (holder.py), where they are.
        self._holder: Holder | None = None
        # What the trial's folder says of this container's limits (limits.py).
        self._limits: list[str] = []
        super().__init__(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config,
            logger=logger,
            **harbors,
        )
        self.workdir = self._workdir_kwarg or self.task_env_config.workdir or DEFAULT_WORKDIR
        self.sif_path: Path | None = None
        self.image = ImageConfig()
        self._scratch: PrivateDir | None = None
        self._main: Container | None = None
        self._compose: Compose | None = None
        self._sidecars: dict[str, Sidecar] = {}
        self._watchdog: MemoryWatchdog | None = None
        self._disk_watchdog: DiskWatchdog | None = None
        # The OOM kills in this process's memory cgroup when the container started (None: no
        # cgroup says): a kill since is the job's memory running out.
        self._oom_kills_at_start: int | None = None
        self._own_network = False
        self._network_problem: str | None = None  # why it shares the node's network
        self._network: OwnNetwork | None = None
        self._egress: Egress | None = None
        self._gpus: list[str] = []
        self.hostname = container_hostname()

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

    @override
    def validate_network_policy_support(self, network_policy: NetworkPolicy | None = None) -> None:
        """Harbor's check, with the reason where no network cannot be had here."""
        policy = network_policy or self._network_policy
        problem = netns_problem()
        if policy.network_mode == NetworkMode.NO_NETWORK and problem is not None:
            raise UnsupportedTask(
                f"task {self.environment_name} asks for no network, which takes a network "
                f"namespace, and this node gives none: {problem}; {NETNS_HINT}, or run the task "
                "where `harbor-hpc doctor` says `network policies: ok`"
            )
        if policy.network_mode == NetworkMode.ALLOWLIST:
            problem = egress_problem()
            if problem is not None:
                raise UnsupportedTask(
                    f"task {self.environment_name} asks for an allowlist of hosts, which this "
                    f"node cannot enforce: {problem}; run the task where `harbor-hpc doctor` "
                    "says `network policies: ok`"
                )
        super().validate_network_policy_support(network_policy)

    @classmethod
    @override
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        """Before Harbor queues any trial: is there a runtime that starts (Apptainer, or enroot
        where that is the `runtime`), to run them with?"""
        super().preflight(kwargs)
        problem = install_problem((kwargs or {}).get("runtime"))
        if problem is not None:
            raise SystemExit(problem)

    @override
    def _validate_definition(self) -> None:
        # A missing or unconvertible image is reported by start(), where Harbor records
        # it in the trial's result instead of failing before the trial exists.
        return

    @property
    def process_pid(self) -> int | None:
        """The host pid at the root of the main container's process tree (while it runs)."""
        return self._main.pid if self._main is not None else None

    @property
    def _private_dir(self) -> Path | None:
        """The trial's private folder on the host (while the environment runs)."""
        return self._scratch.path if self._scratch is not None else None

    @property
    def staging_host_dir(self) -> Path | None:
        """The host folder mounted at /staging (while the environment runs)."""
        return self._private_dir / "staging" if self._private_dir is not None else None

    # -- the images ---------------------------------------------------------

    def _store(self) -> Path:
        from harbor_hpc.core.config import cache_dir as default_store

        return default_store(self._cache_dir)

    async def _resolve_image(self, force: bool) -> Path:
        image = self.task_env_config.docker_image
        if not image:
            raise ImageUnavailable(
                f"task {self.environment_name}: task.toml sets no environment.docker_image; "
                "set it to a .sif path or a registry reference (`harbor-hpc rewrite --sif` "
                "does this)"
            )
        from harbor_hpc.containers.store import checked_sif, ensure_sif, sif_file

        path = sif_file(image, self.environment_dir)
        if path is not None:
            if not path.is_file():
                raise ImageUnavailable(
                    f"task {self.environment_name}: the image {image} does not exist; build or "
                    "convert it into that store first (harbor-hpc build, harbor-hpc convert) or "
                    "fix docker_image"
                )
            where = path.parent
            # A store's .sif is verified against its recorded sha256 (rebuilt when damaged).
            fetch: Callable[[], Path] = functools.partial(checked_sif, path, nohttps=self._nohttps)
        else:
            where = self._store()
            fetch = functools.partial(ensure_sif, image, where, nohttps=self._nohttps, force=force)
        try:
            return await asyncio.to_thread(fetch)
        except HarborHpcError as exc:
            hint = f" ({exc.hint})" if exc.hint else ""
            raise ImageUnavailable(
                f"task {self.environment_name}: the image {image} could not be made ready "
                f"in {where}: {exc.message}{hint}"
            ) from exc

    def _refuse_foreign(self, sif: Path, services: dict[str, Path]) -> None:
        """Refuse an image built for another architecture than this node's, in those words:
        Apptainer would say so of a plain `exec`, but a root mounted from the partition
        (holder.py) would only fail at its first program."""
        for name, path in [(None, sif), *services.items()]:
            if (why := foreign_architecture(path)) is not None:
                of = f"service {name}'s image" if name else "its image"
                raise ImageUnavailable(f"task {self.environment_name}: {of} {path}: {why}")

    def _load_compose(self) -> Compose | None:
        """The task's compose services (its own file, then the run's extra_docker_compose)."""
        try:
            return load_compose(self.environment_dir, self.extra_docker_compose_paths)
        except UnsupportedCompose as exc:
            raise UnsupportedTask(f"task {self.environment_name}: {exc}") from None

    async def _service_sifs(self) -> dict[str, Path]:
        """Each compose service's image, ready in the .sif store (built there when missing)."""
        assert self._compose is not None
        store, found = self._store(), {}
        for service in self._compose.services:
            try:
                found[service.name] = await asyncio.to_thread(
                    service_sif, service, self.environment_dir, store, nohttps=self._nohttps
                )
            except ImageUnavailable as exc:
                raise ImageUnavailable(f"task {self.environment_name}: {exc}") from exc
        return found

    # -- start ----------------------------------------------------------------

    @override
    async def start(self, force_build: bool) -> None:
        _raise_soft_limits()
        self._compose = self._load_compose()
        self.sif_path = await self._resolve_image(force_build or self._force_pull)
        service_sifs = await self._service_sifs() if self._compose else {}
        self._refuse_foreign(self.sif_path, service_sifs)
        self.image = image_config(self.sif_path) or ImageConfig()
        if not (self._workdir_kwarg or self.task_env_config.workdir):
            self.workdir = self.image.workdir or DEFAULT_WORKDIR
        self._choose_network()
        if self._effective_gpus:
            try:
                self._gpus = gpus.take(self._effective_gpus)
            except RuntimeError as exc:
                raise ContainerStartFailed(f"task {self.environment_name}: {exc}") from exc
        self._prepare_scratch()
        try:
            flags = await self._hold_or_flags()
            await self._launch(flags)
            self._record_limits()
            # As Docker's environment leaves them: Harbor's log folders (bound from the trial's
            # private folder) writable by whichever user the task's [agent] and [verifier] run
            # as, not only by the container's root.
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._start_services(flags, service_sifs)
            await self._start_entrypoint()
            await self._run_setup_script()
        except BaseException:
            await self.stop(delete=True)
            raise
        await self._upload_environment_dir_after_start()

    def _record_limits(self) -> None:
        """Say in the trial's folder (and its log) where this container is weaker than
        Docker's: one id without a subuid range, the node's network, not root, in memory."""
        assert self._main is not None
        limits = []
        if self._main.root_user is None:
            limits.append(AS_YOU)
        if ROOT_MAPPED in self._main.stderr_text():
            limits.append(ONE_ID)
        runtime = self._main.runtime
        if not runtime.fakes_other_ids and self._holder and not self._holder.subids:
            limits.append(ONE_ID_ENROOT)
        if self._network_problem is not None:
            limits.append(node_network(self._network_problem))
        if writes_in_memory():
            limits.append(WRITABLE_TMPFS)
        elif self._scratch is not None and filesystem_type(self._scratch.path) == "tmpfs":
            limits.append(IN_MEMORY)
        self._limits = limits
        for limit in limits:
            self.logger.warning("task %s: %s", self.environment_name, limit)
        if self._network_problem is not None:
            self.logger.warning(
                "task %s: for a network of its own, %s", self.environment_name, network_hint()
            )
        write_limits(self.trial_paths.trial_dir, limits)

    @property
    def _scratch_parent(self) -> Path:
        return self._scratch_root or Path(tempfile.gettempdir())

    async def _hold_or_flags(self) -> tuple[str, ...]:
        """Start the namespaces the containers' own roots are mounted in, where this node takes
        that path (holder.py): no flags then. Else Apptainer's flags for this user (`run_flags`),
        the path taken, and why, said in the trial's log."""
        assert self._main is not None
        path = None
        runtime = self._main.runtime
        if not runtime.as_user and not self._fakeroot:
            raise ContainerStartFailed(
                f"task {self.environment_name}: {runtime.name} runs a task as root in its "
                "container: fakeroot=false needs Apptainer (runtime=apptainer)"
            )
        if self._fakeroot:
            subids = not missing_subid_ranges()
            path = await asyncio.to_thread(root_path, self._scratch_parent, subids=subids)
        if path is not None and path.own:
            try:
                holder = await Holder.take(path)
            except HolderFailed as exc:
                give_up(self._scratch_parent, f"its namespaces did not start: {exc}")
            else:
                self._holder = self._main.holder = holder
                self.logger.info(
                    "task %s: container root: %s%s",
                    self.environment_name,
                    path.describe(runtime.name),
                    f", started by {runtime.name}" if runtime.own_root_only else "",
                )
                return ()
            path = root_path(self._scratch_parent, subids=subids)
        if runtime.own_root_only:
            # Apptainer's own overlay is the only other path, which this runtime cannot take.
            why = path.describe() if path is not None else "not asked"
            raise ContainerStartFailed(
                f"task {self.environment_name}: {runtime.name} starts containers on a root of "
                f"our own, which this node cannot mount: {why} (`harbor-hpc doctor` says why)"
            )
        if path is not None:
            self.logger.warning(
                "task %s: container root: %s", self.environment_name, path.describe()
            )
        self._root_fallback = path.describe() if path is not None else "fakeroot=false"
        if self._restore_from is not None:
            raise ContainerStartFailed(
                f"task {self.environment_name}: a container restored from a snapshot needs a "
                f"root of our own, which this node cannot mount: {self._root_fallback} "
                "(`harbor-hpc doctor` says why)"
            )
        try:
            assert self.sif_path is not None
            return await asyncio.to_thread(run_flags, self.sif_path, fakeroot=self._fakeroot)
        except HarborHpcError as exc:
            raise ContainerStartFailed(
                f"task {self.environment_name}: {exc.message} ({exc.hint})"
            ) from exc

    async def _lease_root(self, container: Container) -> None:
        """The lower folder of `container`'s own root (the task's, a compose service's): its
        image unpacked on this node where it is (roots.py), else (None) its .sif."""
        if self._roots is None:
            return
        lease = await asyncio.to_thread(self._roots.lease, container.sif)
        if lease is not None:
            self._root_leases.append(lease)
            container.root = lease.root

    def _hosts(self, hostname: str) -> str:
        """/etc/hosts for a container of the pod named `hostname`: every service's name at
        127.0.0.1 (they share one loopback), then the user's extra_hosts."""
        pod = {name: ["127.0.0.1"] for name in (self._compose.names() if self._compose else [])}
        text = hosts_file(
            hostname, own_network=self._own_network, extra={**pod, **self._extra_hosts}
        )
        if not (self._own_network or self._no_network):
            # The node's network, as Docker's host network: the node's names too.
            with contextlib.suppress(OSError):
                text = Path("/etc/hosts").read_text() + text
        return text

    def _prepare_scratch(self) -> None:
        # The folder is 0700: other users cannot enter it, whatever is inside.
        if self._scratch_root is not None:
            self._scratch_root.mkdir(parents=True, exist_ok=True)
        self._scratch = PrivateDir("harbor-hpc-env-", self._scratch_root)
        private = self._scratch.path
        (private / "tmp").mkdir()
        # What Docker writes into every container (apt's `_apt` reads them too: 0644).
        files = {
            "resolv.conf": RESOLV_CONF,
            "hostname": f"{self.hostname}\n",
            "hosts": self._hosts(self.hostname),
        }
        for name, text in files.items():
            (private / name).write_text(text)
            (private / name).chmod(0o644)
        env = dict(self.image.env)
        if self._compose is not None:
            env.update(self._compose.main.environment)
        if self._gpus and gpus.node_driver() == "--nv":
            # The driver's libraries where --nv binds them, as Docker's runtime installs them.
            env["LD_LIBRARY_PATH"] = ":".join(
                part for part in (env.get("LD_LIBRARY_PATH", ""), gpus.DRIVER_LIBS) if part
            )
        assert self.sif_path is not None
        self._main = Container(
            f"task {self.environment_name}", private, self.sif_path, self.image, self.logger
        )
        try:
            self._main.runtime = container_runtime(self._runtime_setting)
        except HarborHpcError as exc:
            raise ContainerStartFailed(f"task {self.environment_name}: {exc.message}") from exc
        self._main.stage(env, self.environment_dir / "files")

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
        self._network_problem = problem

    def _volume_binds(self, volumes: list[Volume]) -> list[str]:
        """`-B` options for compose volumes: host paths as they are, named volumes as folders
        of the trial's private folder that every service naming them shares."""
        assert self._private_dir is not None
        binds = []
        for volume in volumes:
            source = Path(volume.source)
            if volume.named:
                source = self._private_dir / "volumes" / volume.source
                source.mkdir(parents=True, exist_ok=True)
            elif not source.exists():
                source.mkdir(parents=True)  # as Docker makes a missing bind source
            binds += ["-B", f"{source}:{volume.target}{':ro' if volume.read_only else ''}"]
        return binds

    def _options(self) -> list[str]:
        """The main container's Apptainer options: its binds, its name, its GPUs."""
        assert self._main is not None and self._private_dir is not None
        binds = self._main.mounts()
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
        if self._compose is not None:
            binds += self._volume_binds(self._compose.main.volumes)
        if self._gpus:
            binds += gpus.container_options(self._gpus)
        return ["--env", f"HARBOR_STAGING={ENV_FILES}", *binds]

    def _command(self, flags: tuple[str, ...]) -> list[str]:
        assert self._main is not None
        return self._main.command(
            flags,
            self.workdir,
            own_network=self._no_network or self._own_network,
            options=self._options(),
            no_mount=self._no_mount,
        )

    async def _launch(self, flags: tuple[str, ...]) -> None:
        assert self._main is not None
        if self._holder is not None and self._main.merged is None:
            try:
                began = time.monotonic()
                await self._lease_root(self._main)
                await self._main.mount_root(self._options(), above=self._snapshot_layers())
                self.logger.debug(
                    "%s: its root over %s (%.2f s)",
                    self._main.name,
                    self._main.root or self._main.sif,
                    time.monotonic() - began,
                )
            except HolderFailed as exc:
                if self._main.runtime.own_root_only or self._restored is not None:
                    needs = (
                        self._main.runtime.name
                        if self._main.runtime.own_root_only
                        else "a container restored from a snapshot"
                    )
                    raise ContainerStartFailed(
                        f"task {self.environment_name}: its own root failed, which {needs} "
                        f"needs: {exc}"
                    ) from exc
                self.logger.warning(
                    "task %s: its own root failed (%s): Apptainer's own overlay on the .sif",
                    self.environment_name,
                    exc,
                )
                await self._let_go_of_roots()
                assert self.sif_path is not None
                flags = await asyncio.to_thread(run_flags, self.sif_path, fakeroot=True)
        try:
            await self._main.launch(self._command(flags))
        except ContainerStartFailed as exc:
            said = str(exc)
            refused = next((w for w in (SANDBOX_REFUSED, PATH_REFUSED) if w in said), None)
            if self._holder is not None and refused is not None:
                # The site allows no directory container (`allow container dir = no`), or
                # none in the scratch folder (`limit container paths`): not a root of our
                # own, then; Apptainer's overlay on the .sif.
                give_up(self._scratch_parent, f"this node's apptainer.conf: {refused}")
                await self._let_go_of_roots()
                await self._launch(await self._hold_or_flags())
                return
            if OVERLAY_OFF in said:
                raise ContainerStartFailed(
                    f"task {self.environment_name}: this node's apptainer.conf turns overlays "
                    f"off (enable overlay = no): {OVERLAY_OFF_FIX}"
                ) from exc
            if writes_in_memory() or not refuses_overlay_folders(said):
                limit = ran_out(said)
                if limit is None:
                    raise
                raise ContainerStartFailed(f"{said}\n{limit}") from exc
            # The site allows no overlay folder: the container writes in memory instead.
            await self._main.launch(self._command(flags))
        server = self._main.server_pid()
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
        self._oom_kills_at_start = oom_kills()
        if self._watchdog_enabled and memory_mb:
            assert self._main.pid is not None
            if server is None:
                self.logger.debug("no server descriptors on the tmpfs mounts: not counted")
            self._watchdog = MemoryWatchdog(
                self._main.pid,
                limit_bytes=memory_mb * 1024 * 1024,
                kill_fraction=self._kill_fraction,
                interval_sec=self._poll_interval,
                tmpfs_paths=self._main.tmpfs_paths(),
                servers=self._server_pids,
                on_kill=self._note_oom_kill,
            )
            self._watchdog.start()
        storage_mb = self.task_env_config.storage_mb
        if storage_mb and self._private_dir is not None:
            self._disk_watchdog = DiskWatchdog(
                self._private_dir,
                limit_bytes=storage_mb * 1024 * 1024,
                servers=self._server_pids,
                on_kill=self._note_disk_kill,
            )
            self._disk_watchdog.start()

    def _snapshot_layers(self) -> list[Path]:
        """The layers of the snapshot its root starts from (`restore_from`), held from now."""
        if self._restore_from is None:
            return []
        if self._restored is None:
            try:
                self._restored = live_snapshot(self._restore_from)
            except SnapshotRefused as exc:
                raise ContainerStartFailed(f"task {self.environment_name}: {exc}") from None
            self.branch = branch_record(self._restored)
            write_branch(self.trial_paths.trial_dir, self.branch)
        return self._restored.layers

    async def _start_services(self, flags: tuple[str, ...], sifs: dict[str, Path]) -> None:
        """The compose services, each once what it depends on is as its condition asks; then
        what `main` depends on. Each joins the main container's namespaces (pod.py)."""
        if self._compose is None or self._main is None or self._private_dir is None:
            return
        pod_namespaces = self._own_network or self._no_network
        join = None
        if pod_namespaces:
            join = self._main.server_pid()
            if join is None:
                raise ContainerStartFailed(
                    f"task {self.environment_name}: no server process in the container for "
                    "its compose services to join"
                )
        reached: set[tuple[str, str]] = set()

        async def wait_for(depends_on: dict[str, str]) -> None:
            for name, condition in depends_on.items():
                if name != MAIN and (name, condition) not in reached:
                    await self._sidecars[name].reach(condition)
                    reached.add((name, condition))

        for service in self._compose.services:
            await wait_for(service.depends_on)
            private = self._private_dir / "services" / service.name
            private.mkdir(parents=True)
            files = {
                "hosts": self._hosts(service.name),
                "resolv.conf": RESOLV_CONF,
                "hostname": f"{service.name}\n",
            }
            for name, text in files.items():
                (private / name).write_text(text)
                (private / name).chmod(0o644)
            sidecar = Sidecar(
                service, self.environment_name, private, sifs[service.name], self.logger
            )
            self._sidecars[service.name] = sidecar
            if self._holder is not None:
                sidecar.container.holder = self._holder
                sidecar.container.runtime = self._main.runtime
                await self._lease_root(sidecar.container)
            binds = [*sidecar.container.mounts(), "-B", f"{private / 'hosts'}:/etc/hosts"]
            if not sidecar.container.runtime.writes_hostname:
                # Apptainer's --hostname writes /etc/hostname itself; enroot leaves the image's.
                binds += ["-B", f"{private / 'hostname'}:/etc/hostname"]
            if self._own_network:
                binds += ["-B", f"{private / 'resolv.conf'}:/etc/resolv.conf"]
            binds += self._volume_binds(service.volumes)
            await sidecar.start(() if pod_namespaces else flags, binds, join=join)
            if self._watchdog is not None and sidecar.container.pid is not None:
                self._watchdog.add_root(sidecar.container.pid, sidecar.container.tmpfs_paths())
        await wait_for(self._compose.main.depends_on)

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

    async def _start_entrypoint(self) -> None:
        """Start the image's ENTRYPOINT as Docker does under Harbor, which replaces CMD with
        `sh -c "sleep infinity"`: in the background, as the image's user, and go on once it
        ran that command (entrypoints set things up, then `exec "$@"`) and what it started in
        the background is up (`settle`), or it ended, or had ENTRYPOINT_GRACE_SEC."""
        if not self.image.entrypoint or self._main is None:
            return
        ready = self._main.staging / ".hh" / "entrypoint.ready"
        argv = [
            *self.image.entrypoint,
            "sh",
            "-c",
            f": > {SERVER_DIR}/entrypoint.ready; exec sleep infinity",
        ]
        log, ended = await self._main.start_background(
            argv,
            "entrypoint",
            cwd=self.workdir,
            user=self._resolve_user(None),
            env=self._merge_env(None),
        )
        deadline = asyncio.get_running_loop().time() + ENTRYPOINT_GRACE_SEC
        while not (ready.exists() or ended.exists()):
            if asyncio.get_running_loop().time() > deadline:
                self.logger.debug("the ENTRYPOINT still runs; the trial goes on beside it")
                return
            await asyncio.sleep(0.02)
        if ready.exists():
            await self._main.settle()
        elif ended.exists():
            self.logger.warning(
                "the image's ENTRYPOINT exited with %s before reaching its command:\n%s",
                ended.read_text().strip(),
                log.read_text(errors="replace")[-2000:],
            )

    async def _run_setup_script(self) -> None:
        """Source environment/files/setup.sh once, as Harbor's bootstrap does, and keep what
        it exports (a PATH to a venv, say) for every later command."""
        if self._restored is not None:
            # Its files are the ones setup.sh made in the container it was taken from.
            self._persistent_env.update(self._restored.env)
            return
        staging = self.staging_host_dir
        if staging is None or not (staging / "env_files" / "setup.sh").is_file():
            return
        before, after = f"{STAGING}/.hh/env.before", f"{STAGING}/.hh/env.after"
        result = await self.exec(
            f"env -0 > {before}; . {ENV_FILES}/setup.sh; status=$?; env -0 > {after}; exit $status",
            user=self._require_main().root_user,
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

    # -- snapshots and forks ----------------------------------------------------

    async def snapshot(self, step: int | None = None, source: Path | None = None) -> Snapshot:
        """A copy of the main container's filesystem as it is now (snapshot.py): its processes
        stopped while its upper is copied, then going on unchanged. The caller holds it until
        `release()`; `restore` starts containers from it, in this process, on this node.
        `step`: the episode's step (the caller's count), which the restored trials record,
        with the trial it was taken in (`source`: where that trial is, default its folder)."""
        main = self._require_main()
        name = f"task {self.environment_name}"
        server = main.server_pid()
        if main.holder is None or main.merged is None or main.pid is None or server is None:
            raise SnapshotRefused(
                f"{name}: a snapshot copies the container's own root (the kernel's overlay), and "
                f"this container's is not one: {self._root_fallback or 'it is not running'} "
                "(`harbor-hpc doctor`)"
            )
        source = source or self.trial_paths.trial_dir
        taken = Snapshot(self._scratch_parent, self._restored, source, step)
        taken.env = dict(self._persistent_env)
        enter = main.holder.enter()

        def copy() -> None:
            assert main.pid is not None and server is not None
            with stopped(main.pid, server):
                copy_upper(enter, main.root_state / "upper", taken, self._snapshot_cap)

        try:
            await asyncio.to_thread(copy)
        except SnapshotRefused as exc:
            taken.release()
            raise SnapshotRefused(f"{name}: {exc}") from None
        except BaseException:
            taken.release()
            raise
        return taken

    async def restorable(self, step: int | None = None) -> Restorable:
        """A `snapshot` as the kwargs that restore it (`restore_from`), for environments Harbor
        makes (`Sandbox.fork`'s trials)."""
        taken = await self.snapshot(step)

        async def release() -> None:
            taken.release()

        return Restorable({"restore_from": taken.path}, release)

    async def restore(self, snapshot: Snapshot, count: int = 1) -> list[SingularityEnvironment]:
        """`count` environments of this one's class and task started from `snapshot`'s files,
        each a container of its own (its own upper, network, limits, and a trial folder beside
        this one's, `TRIAL.fork-ID`); the image's ENTRYPOINT runs in each, setup.sh not again
        (its exports are carried). Processes are not: a child starts with its command server
        alone. Where one fails to start, the others are stopped and its error raised."""
        if count < 1:
            raise ValueError(f"count={count}: at least 1")
        return await started_all([self._child(snapshot) for _ in range(count)])

    async def fork(self, count: int, step: int | None = None) -> list[SingularityEnvironment]:
        """`count` started copies of this environment as it is now (`snapshot`, `restore`):
        the parent goes on unchanged, and no child sees another's writes."""
        if count < 1:
            raise ValueError(f"count={count}: at least 1")
        taken = await self.snapshot(step)
        try:
            return await self.restore(taken, count)
        finally:
            taken.release()  # the children hold it now

    def _child(self, snapshot: Snapshot) -> SingularityEnvironment:
        paths, session_id = fork_trial(self.trial_paths, self.session_id)
        return type(self)(
            session_id=session_id,
            trial_paths=paths,
            restore_from=snapshot.path,
            **self._made_with,
        )

    # -- exec -----------------------------------------------------------------

    @override
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        main = self._require_main()
        script = main.script(command, cwd, self._merge_env(env), self._resolve_user(user))
        callback = self._output_callback()
        try:
            if callback is None:
                output = await main.run(script, timeout_sec=timeout_sec)
            else:
                output = await self._run_streaming(main, script, timeout_sec, callback)
        except RuntimeError:
            self._raise_if_memory_breached()
            self._raise_if_oom_killed()
            raise
        self._raise_if_oom_killed()
        if ENOSPC_TEXT in output.stdout or ENOSPC_TEXT in output.stderr:
            self._note_full_disk()
        return _exec_result(output)

    def _note_full_disk(self) -> None:
        """A command printed ENOSPC's words: where the scratch disk (the container's writable
        layer, its /tmp) is nearly full now, say so in the trial's folder, once, so that a reward
        it cost is named, not learned from. A task that fills a disk of its own making, or one
        with room left, is the task's."""
        noted = any(limit.startswith(DISK_FULL_PREFIX) for limit in self._limits)
        if self._scratch is None or noted:
            return
        try:
            stats = os.statvfs(self._scratch.path)
        except OSError:
            return
        free = stats.f_bavail * stats.f_frsize
        if free >= FULL_BELOW_BYTES:
            return
        limit = disk_full(str(self._scratch.path.parent), free)
        self._limits.append(limit)
        self.logger.warning("task %s: %s", self.environment_name, limit)
        write_limits(self.trial_paths.trial_dir, self._limits)

    async def _run_streaming(
        self, main: Container, script: bytes, timeout_sec: int | None, callback: Any
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
            return await main.run(
                script,
                timeout_sec=timeout_sec,
                on_chunk=lambda stream, data: queue.put_nowait((stream, data)),
            )
        finally:
            queue.put_nowait(None)
            await pumping

    def _require_main(self) -> Container:
        self._raise_if_memory_breached()
        if self._main is None or self._main.channel is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        return self._main

    def _server_pids(self) -> list[int]:
        """The host pids of the command servers of the main container and its services: what
        is below them is the task's (the watchdog's to kill, one process at a time)."""
        containers = [self._main, *[sidecar.container for sidecar in list(self._sidecars.values())]]
        return [pid for c in containers if c is not None and (pid := c.server_pid()) is not None]

    def _note_oom_kill(self, kill: OomKill) -> None:
        """A process the watchdog killed for the memory limit, as Docker's OOM killer would: the
        trial goes on (the policy's outcome); its log says what was killed, as the kernel's
        would."""
        self.logger.warning("task %s: %s", self.environment_name, kill.describe())

    def _note_disk_kill(self, kill: DiskKill) -> None:
        """A process the disk watchdog killed for the task's storage_mb: the policy's outcome,
        as a write that met a full disk would be; the log says what was killed."""
        self.logger.warning("task %s: %s", self.environment_name, kill.describe())

    def _raise_if_memory_breached(self) -> None:
        if self._watchdog is not None and self._watchdog.breach is not None:
            raise MemoryLimitExceededError(
                f"task {self.environment_name}: {self._watchdog.breach.describe()}"
            )

    def _raise_if_oom_killed(self) -> None:
        """The kernel's OOM killer acted in this process's memory cgroup while the container
        ran: the job's memory (Slurm's --mem) ran out before the task reached its memory_mb,
        which the watchdog holds it to, and it killed the biggest process of the job, maybe
        this task's, where Docker would have let it live. Not the agent's doing: named, never a
        reward (every trial of the job that ran then is named, as any may have lost one)."""
        before = self._oom_kills_at_start
        now = oom_kills() if before is not None else None
        if before is None or now is None or now <= before:
            return
        limit = memory_limit_mb()
        held = f"{limit} MB" if limit is not None else "its memory"
        raise MemoryLimitExceededError(
            f"task {self.environment_name}: the kernel's OOM killer ended {now - before} "
            f"process(es) of the job this trial runs in, held to {held} (a Slurm job's --mem, "
            "with ConstrainRAMSpace), before the task reached its memory_mb of "
            f"{self._effective_memory_mb} MB: give the job more memory (--mem, or leave it out "
            "to have it sized), or run fewer trials at once in it (--concurrency)"
        )

    # -- files ------------------------------------------------------------------

    @override
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        with self._noting_full_disk():
            await self._require_main().upload_file(Path(source_path), target_path)

    @override
    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        with self._noting_full_disk():
            await self._require_main().upload_dir(Path(source_dir), target_dir)

    @override
    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        with self._noting_full_disk():
            await self._require_main().download_file(source_path, Path(target_path))

    @override
    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        with self._noting_full_disk():
            await self._require_main().download_dir(source_dir, Path(target_dir))

    @contextlib.contextmanager
    def _noting_full_disk(self) -> Iterator[None]:
        """A transfer through the staging folder (on the scratch disk) that failed for want of
        room (the tests' upload before the verifier, the logs' download) is the disk's."""
        try:
            yield
        except Exception as exc:
            if ENOSPC_TEXT.decode() in str(exc) or getattr(exc, "errno", None) == errno.ENOSPC:
                self._note_full_disk()
            raise

    # -- compose services (Harbor's per-service operations) -------------------------

    def _sidecar(self, service: str) -> Container:
        sidecar = self._sidecars.get(service)
        if sidecar is None or sidecar.container.channel is None:
            known = ", ".join(self._sidecars) or "none"
            raise ValueError(
                f"task {self.environment_name}: no running compose service {service!r} "
                f"(services: {known})"
            )
        self._raise_if_memory_breached()
        return sidecar.container

    @override
    async def service_exec(
        self,
        command: str,
        *,
        service: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if service is None or self.is_main_service(service):
            return await self.exec(command, cwd=cwd, env=env, timeout_sec=timeout_sec, user=user)
        container = self._sidecar(service)
        # As Harbor's compose providers: a service's exec takes nothing of main's defaults.
        output = await container.run(container.script(command, cwd, env, user), timeout_sec)
        return _exec_result(output)

    @override
    async def service_download_file(
        self, source_path: str, target_path: Path | str, *, service: str | None = None
    ) -> None:
        if service is None or self.is_main_service(service):
            await self.download_file(source_path, target_path)
            return
        await self._sidecar(service).download_file(source_path, Path(target_path))

    @override
    async def service_download_dir(
        self, source_dir: str, target_dir: Path | str, *, service: str | None = None
    ) -> None:
        if service is None or self.is_main_service(service):
            await self.download_dir(source_dir, target_dir)
            return
        await self._sidecar(service).download_dir(source_dir, Path(target_dir))

    @override
    async def stop_service(self, service: str) -> None:
        """Stop one service, the rest of the pod running on (its namespaces stay while any of
        its containers is in them)."""
        if self.is_main_service(service):
            container = self._require_main()
            writable = self._mount_targets(writable_only=True)
        else:
            container = self._sidecar(service)
            writable = self._volume_targets(self._sidecars[service].service.volumes)
        await container.stop(writable)

    @staticmethod
    def _volume_targets(volumes: list[Volume]) -> list[str]:
        return [volume.target for volume in volumes if not volume.read_only]

    # -- stop -------------------------------------------------------------------

    async def _let_go_of_roots(self) -> None:
        """End the holder's namespaces (every process and mount in them) and the leases of
        the unpacked roots its containers' roots were mounted over."""
        if self._holder is not None:
            await self._holder.stop()
            self._holder = None
        for container in [self._main, *(s.container for s in self._sidecars.values())]:
            if container is not None:
                container.holder = container.merged = container.root = None
        for lease in self._root_leases:
            lease.release()
        self._root_leases = []
        if self._restored is not None:
            self._restored.release()
            self._restored = None

    @override
    async def stop(self, delete: bool) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._disk_watchdog is not None:
            self._disk_watchdog.stop()
        for sidecar in reversed(list(self._sidecars.values())):
            await sidecar.container.stop(self._volume_targets(sidecar.service.volumes))
        self._sidecars = {}
        if self._main is not None:
            writable = list(self._mount_targets(writable_only=True))
            if self._compose is not None:
                writable += self._volume_targets(self._compose.main.volumes)
            await self._main.stop(writable)
            logs = [self.trial_paths.agent_dir, self.trial_paths.verifier_dir]
            said = await asyncio.to_thread(_logs_say, logs, (ENOSPC_TEXT,))
            if ENOSPC_TEXT in said:
                self._note_full_disk()
            self._main = None
        await self._let_go_of_roots()
        if self._egress is not None:
            await self._egress.close()
            self._egress = None
        if self._network is not None:
            await self._network.close()
            self._network = None
        gpus.give_back(self._gpus)
        self._gpus = []
        if self._scratch is not None:
            if not await asyncio.to_thread(self._scratch.remove):
                self.logger.warning("could not remove all of %s", self._scratch.path)
            self._scratch = None
        # The .sif stays: it is the shared cache, whatever `delete` says.
