"""A Harbor environment whose container runs on another node of a Ray cluster.

`-e harbor_hpc.environment:RaySingularityEnvironment`: for a trainer on GPU nodes whose
rollouts' containers belong on CPU nodes. Each environment is a placement group of one bundle
(the task's cpus and memory, and the node labels asked for), so Ray chooses the node and
accounts for what it holds; the container then runs there in that node's `EnvironmentHost`
(harbor_hpc/ray/host.py) as the local `SingularityEnvironment` runs it: the same image store,
fidelity and memory watchdog. Commands and files go through Ray calls, files in chunks.

Nothing waits on a host blindly: a call that has not answered within `LIVENESS_SEC` probes its
host (and, when the host is silent, the cluster about its node), and a node lost, a host killed
or a cluster gone ends the environment with `EnvironmentHostUnavailable` naming the node, an
infrastructure failure (never trainable); a host that is only busy is waited for. A host Ray
calls temporarily unavailable (`ActorUnavailableError`: a connection broken, say by another
node's loss, the call run or not) is waited for while its node lives, and the call asked
again with its id, which the host runs once (host.py): never a reason to end the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, ClassVar, override

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import (
    EnvironmentCapabilities,
    EnvironmentResourceCapabilities,
)
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import EnvironmentConfig, NetworkPolicy
from harbor.models.trial.paths import TrialPaths
from pydantic import Field

from harbor_hpc.containers.branch import write_branch
from harbor_hpc.containers.environment import (
    BASE_KWARGS,
    SingularityEnvironment,
    environment_capabilities,
)
from harbor_hpc.containers.environment_kwargs import accepted_environment_kwargs
from harbor_hpc.containers.errors import (
    ContainerDied,
    ContainerStartFailed,
    EnvironmentHostUnavailable,
)
from harbor_hpc.containers.options import SingularityOptions
from harbor_hpc.containers.snapshot import Restorable, fork_trial, started_all
from harbor_hpc.ray.cluster import INSTALL_HINT, parse_labels, ray_missing
from harbor_hpc.ray.connect import cluster_problem, connect
from harbor_hpc.ray.host import (
    CHUNK_BYTES,
    EnvironmentHost,
    EnvironmentSpec,
    ExecRequest,
    pack,
    unpack,
)
from harbor_hpc.results.record import say_waiting

# How long a call may go unanswered before its host is probed, and how long the probe may
# take: a lost node or a dead host is Ray's news at once (its calls fail); the probe is for a
# cluster that stopped answering at all. The probe has a thread of the host to itself (its
# concurrency group), yet a host starting a hundred containers on a loaded node can leave it
# unanswered for most of a minute (seen at Ray's default worker niceness, 15): a probe unanswered is
# then put to the cluster, and only a node it no longer counts alive (or no answer from the
# cluster either) gives the host up.
LIVENESS_SEC = 10.0
PROBE_TIMEOUT_SEC = 30.0
PROBE_GROUP = "probe"
# What a command with a timeout gets beyond it to come back, before its host is given up on.
CALL_GRACE_SEC = 30.0
# How long a host Ray calls temporarily unavailable is waited for while its node lives, and
# how long its cluster may take to take a connection before it counts as gone.
UNAVAILABLE_WAIT_SEC = 120.0
GCS_CONNECT_SEC = 3.0
STOP_TIMEOUT_SEC = 60.0
# How long after its host said a container died the host is asked whether it lives itself.
DIED_SETTLE_SEC = 1.0
# Harbor's own kwargs the container's host has no use for: the trial's log folders are not
# mounted from the driver's filesystem (they are copied, `mounted=False`).
_DRIVER_ONLY = frozenset({"mounts", "stream"})
# The label every Ray node has: its id (`ray.util.placement_group.NODE_ID_LABEL_KEY`).
NODE_ID_LABEL = "ray.io/node-id"
# The copies of this driver's snapshots on other nodes than their own: by the snapshot's path,
# each node's id and its copy's path there (`_fetch`), released with the snapshot.
_fetched: dict[str, dict[str, asyncio.Future[str]]] = {}
# Host actors of this process, by node id: one per node, made on first use.
_hosts: dict[str, tuple[Any, str]] = {}
# How many hosts of this process each node lost (the next host's name says it).
_lost_hosts: dict[str, int] = {}
_hosts_lock = threading.Lock()


def _first_sentence(error: Exception) -> str:
    """What Ray says went wrong, without the paragraphs of advice that follow."""
    return " ".join(str(error).split()).split(". ")[0][:300]


def _labels(text: str | None) -> dict[str, str]:
    """`key=value,key2=!value2` as Ray's label selector."""
    try:
        return parse_labels(text)
    except ValueError:
        raise ContainerStartFailed(f"ray_labels: {text!r} is not key=value[,key=value]") from None


def _node_record(node_id: str) -> dict[str, Any] | None:
    """The cluster's (its GCS's) record of the node; blocks while the cluster does not answer."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return next((node for node in nodes if node["NodeID"] == node_id), None)


def _host_on(node_id: str) -> tuple[Any, str]:
    """This process's host actor on `node_id` (an actor handle) and the node's address."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    with _hosts_lock:
        if node_id not in _hosts:
            record = _node_record(node_id)
            address = str(record["NodeManagerAddress"]) if record else node_id
            # Ray's typed overloads of remote() leave its documented concurrency_groups out.
            host = ray.remote(concurrency_groups={PROBE_GROUP: 1})  # type: ignore[call-overload]
            actor = (
                host(EnvironmentHost)
                .options(
                    # A name of its own after a host was lost: Ray may still hand out the
                    # dead one by the old name for a while (its death not yet processed).
                    name=f"harbor-hpc-host-{node_id}-{_lost_hosts.get(node_id, 0)}",
                    get_if_exists=True,
                    num_cpus=0,
                    max_concurrency=10_000,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                .remote()
            )
            _hosts[node_id] = (actor, address)
        return _hosts[node_id]


def _node_alive(node_id: str) -> bool:
    """Whether the cluster counts the node alive; blocks while it does not answer."""
    record = _node_record(node_id)
    return bool(record and record["Alive"])


def _cluster_unreachable() -> str | None:
    """Why the cluster's GCS takes no connection at all (its head gone: refused; its network
    cut: no answer within GCS_CONNECT_SEC), or None when it takes one. A loaded GCS still
    takes connections: the kernel answers for it."""
    import ray

    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=GCS_CONNECT_SEC).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _forget_host(node_id: str) -> None:
    with _hosts_lock:
        if _hosts.pop(node_id, None) is not None:
            _lost_hosts[node_id] = _lost_hosts.get(node_id, 0) + 1


class RayOptions(SingularityOptions):
    """The kwargs of `RaySingularityEnvironment`: those of `SingularityEnvironment`, which
    its container's node takes, and where on the Ray cluster that container goes."""

    ray_address: str | None = Field(
        None,
        description="The cluster's address (default: the cluster `harbor-hpc ray up` started, "
        "else $RAY_ADDRESS; a process that already joined one keeps it).",
    )
    ray_cluster_dir: Path | None = Field(
        None, description="The folder of the `ray up` cluster (default: ray up's)."
    )
    ray_cpus: float | None = Field(
        None,
        gt=0,
        description="The CPUs Ray reserves for the environment (default: the task's cpus); "
        "fewer packs more idle environments per node.",
    )
    ray_labels: str | None = Field(
        None,
        description="Node labels the environment's node must have, `key=value,...` in Ray's "
        "label-selector syntax (`role=env`, `accel=!gpu`).",
    )
    ray_placement_timeout_sec: float = Field(
        600.0, gt=0, description="How long to wait for a node with room."
    )
    ray_restore_node: str | None = Field(
        None,
        description="The Ray node id holding `restore_from`'s snapshot (what `fork` and "
        "`restorable` set): the container goes there where it has room at once, else to any "
        "node with room, the snapshot copied there once.",
    )

    @classmethod
    def ray_fields(cls) -> frozenset[str]:
        """Those this class adds: the driver's alone, not the container's node's."""
        return frozenset(cls.model_fields) - frozenset(SingularityOptions.model_fields)


RAY_OPTIONS = frozenset(RayOptions.model_fields)


class RaySingularityEnvironment(BaseEnvironment):  # type: ignore[misc]  # harbor ships no types
    """Runs a task's container on a node of a Ray cluster, in `SingularityEnvironment`.

    Kwargs (`--environment-kwarg k=v`): `RayOptions`, every one of `SingularityEnvironment`
    and where on the Ray cluster its container goes.
    """

    options_model: ClassVar[type[EnvironmentOptions] | None] = RayOptions

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
        # What a fork's children are made with (`fork`), a session and trial of their own.
        self._made_with: dict[str, Any] = {
            "environment_dir": environment_dir,
            "environment_name": environment_name,
            "task_env_config": task_env_config,
            "logger": logger,
            **{k: v for k, v in kwargs.items() if k not in {"restore_from", "ray_restore_node"}},
        }
        harbors = {k: v for k, v in kwargs.items() if k in BASE_KWARGS - RAY_OPTIONS}
        try:
            self.options = self.parse_options({k: v for k, v in kwargs.items() if k not in harbors})
        except ValueError as exc:
            raise ContainerStartFailed(
                f"{exc}\naccepted: {', '.join(accepted_environment_kwargs(type(self)))}"
            ) from None
        options = self.options
        assert isinstance(options, RayOptions)
        self._ray_address = options.ray_address
        self._cluster_dir = (
            options.ray_cluster_dir.expanduser() if options.ray_cluster_dir else None
        )
        self._ray_cpus = options.ray_cpus
        self._ray_labels = _labels(options.ray_labels)
        self._placement_timeout = options.ray_placement_timeout_sec
        self._restore_node = options.ray_restore_node
        kwargs = {k: v for k, v in kwargs.items() if k not in RayOptions.ray_fields()}
        # The host's environment takes the user's kwargs and Harbor's; this one only Harbor's
        # (the setup script's exports live with the container, so the persistent env does).
        self._forwarded = {key: value for key, value in kwargs.items() if key not in _DRIVER_ONLY}
        super().__init__(
            environment_dir=environment_dir,
            environment_name=environment_name,
            session_id=session_id,
            trial_paths=trial_paths,
            task_env_config=task_env_config,
            logger=logger,
            **{
                key: value
                for key, value in kwargs.items()
                if key in BASE_KWARGS and key != "persistent_env"
            },
        )
        self._id = uuid.uuid4().hex
        self._group: Any = None
        self._node_id: str | None = None
        self._host: Any = None
        self._node = "(not placed yet)"
        self._lost = False

    @staticmethod
    @override
    def type() -> str:
        return "harbor-hpc-ray-apptainer"

    @classmethod
    @override
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return SingularityEnvironment.resource_capabilities()

    @property
    @override
    def capabilities(self) -> EnvironmentCapabilities:
        # The log folders are on the container's node, not mounted from here: Harbor copies them.
        # The node enforces a network policy, or its environment refuses to start, naming why.
        # GPUs are not reserved on Ray nodes (a placement group holds CPUs and memory only).
        # Compose services run as a pod on the node; their operations are relayed there.
        return environment_capabilities(mounted=False, egress=True, netns=True, gpus=False)

    @override
    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        if self._host is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        await self._call("set_network_policy", self._id, network_policy)

    @classmethod
    @override
    def preflight(cls, kwargs: dict[str, Any] | None = None) -> None:
        super().preflight(kwargs)
        problem = ray_missing()
        if problem is not None:
            raise SystemExit(f"{problem}: {INSTALL_HINT}")
        # Once, before any trial: a cluster that does not answer would fail every environment,
        # each after its own wait.
        given = kwargs or {}
        folder = given.get("ray_cluster_dir")
        problem = cluster_problem(
            given.get("ray_address"), Path(folder).expanduser() if folder else None
        )
        if problem is not None:
            raise SystemExit(problem)

    @override
    def _validate_definition(self) -> None:
        return  # as the local environment: start() reports what is wrong, into the trial

    @property
    def node(self) -> str:
        """The address of the node the container runs on (once placed)."""
        return self._node

    @property
    def node_id(self) -> str | None:
        """The Ray node id of that node (once placed)."""
        return self._node_id

    # -- calls to the host ------------------------------------------------------------

    def _unavailable(self, what: str) -> EnvironmentHostUnavailable:
        self._lost = True  # nothing more is asked of that host, stop() included
        if self._node_id is not None:
            _forget_host(self._node_id)  # the next environment there gets a host of its own
        return EnvironmentHostUnavailable(
            f"task {self.environment_name}: its Ray node {self._node} (node id "
            f"{(self._node_id or '?')[:12]}) {what}"
        )

    async def _call(self, method: str, *args: Any, timeout_sec: float | None = None) -> Any:
        """The host's `method(*args)`, run there once (`EnvironmentHost.call`) however often
        it must be asked."""
        assert self._host is not None
        call = functools.partial(self._host.call.remote, uuid.uuid4().hex, method, *args)
        return await self._ask(call, timeout_sec)

    async def _ask(self, make: Callable[[], Any], timeout_sec: float | None = None) -> Any:
        """What the call `make()` sends returns or raised there; its host's loss as one error,
        found by probing the host whenever the call is quiet for LIVENESS_SEC; the same call
        sent again once a host Ray called unavailable answers again."""
        import ray
        from ray.exceptions import ActorUnavailableError

        loop = asyncio.get_running_loop()
        deadline = None if timeout_sec is None else loop.time() + timeout_sec + CALL_GRACE_SEC
        while True:
            ref = make()
            answer = asyncio.wrap_future(ref.future())
            try:
                while True:
                    wait = LIVENESS_SEC if deadline is None else max(0, deadline - loop.time())
                    done, _ = await asyncio.wait({answer}, timeout=min(wait, LIVENESS_SEC))
                    if done:
                        break
                    if deadline is not None and loop.time() >= deadline:
                        raise self._unavailable(f"did not answer within {timeout_sec} s and more")
                    await self._probe()
            except asyncio.CancelledError:
                ray.cancel(ref)  # the command stops there too (Harbor gave up on it)
                raise
            try:
                return self._result(answer)
            except ActorUnavailableError as exc:
                await self._wait_until_available(_first_sentence(exc))
            except ContainerDied as died:
                if isinstance(died, EnvironmentHostUnavailable):
                    raise
                # A node that crashes kills its processes one after another: a host may see
                # its container die, and answer so, just before it dies too. The node's loss
                # is what ended the container then.
                await asyncio.sleep(DIED_SETTLE_SEC)
                await self._probe()
                raise

    def _result(self, answer: asyncio.Future[Any]) -> Any:
        from ray.exceptions import ActorUnavailableError, RayError, RayTaskError

        try:
            return answer.result()
        except RayTaskError as exc:
            # What the host raised, as it raised it: Harbor records the type by name.
            raise exc.cause from None
        except ActorUnavailableError:
            raise  # for the caller to wait for, and ask again
        except RayError as exc:
            raise self._unavailable(f"was lost: {_first_sentence(exc)}") from None

    async def _wait_until_available(self, why: str) -> None:
        """Until the host answers again; its node's loss, or UNAVAILABLE_WAIT_SEC without an
        answer, ends the environment."""
        self.logger.info(
            "task %s: Ray calls its host on %s unavailable (%s): waiting for it",
            self.environment_name,
            self._node,
            why,
        )
        give_up = asyncio.get_running_loop().time() + UNAVAILABLE_WAIT_SEC
        unreachable = await asyncio.to_thread(_cluster_unreachable)
        if unreachable is not None:  # the cluster itself is gone: nothing to wait for
            raise self._unavailable(f"was lost with its Ray cluster ({unreachable})")
        while not await self._probe():
            if asyncio.get_running_loop().time() > give_up:
                raise self._unavailable(
                    f"was unavailable to Ray calls for {UNAVAILABLE_WAIT_SEC:g} s ({why})"
                )
            await asyncio.sleep(1)

    async def _probe(self) -> bool:
        """Whether the host answers (True), or only its node still lives in the cluster
        (False: a host busy starting containers is slow, not lost, and one Ray calls
        unavailable may come back); anything else raises `EnvironmentHostUnavailable`."""
        from ray.exceptions import ActorUnavailableError, RayError

        assert self._host is not None
        probe = self._host.where.options(concurrency_group=PROBE_GROUP).remote()
        try:
            await asyncio.wait_for(asyncio.wrap_future(probe.future()), PROBE_TIMEOUT_SEC)
            return True
        except ActorUnavailableError:
            pass  # its node decides
        except RayError as exc:
            raise self._unavailable(f"was lost: {_first_sentence(exc)}") from None
        except TimeoutError:
            pass
        assert self._node_id is not None  # a host is only asked for once placed
        try:
            alive = await asyncio.wait_for(
                asyncio.to_thread(_node_alive, self._node_id), PROBE_TIMEOUT_SEC
            )
        except Exception:  # the cluster does not answer either, whatever Ray raises
            raise self._unavailable(
                f"did not answer for {PROBE_TIMEOUT_SEC:g} s, nor did the Ray cluster"
            ) from None
        if not alive:
            raise self._unavailable("is no longer alive in the Ray cluster")
        self.logger.debug(
            "task %s: the host on %s does not answer yet; its node lives",
            self.environment_name,
            self._node,
        )
        return False

    # -- start ---------------------------------------------------------------------------

    def _bundle(self) -> dict[str, float]:
        cpus = self._ray_cpus if self._ray_cpus is not None else float(self._effective_cpus or 1)
        bundle = {"CPU": cpus}
        if self._effective_memory_mb:
            bundle["memory"] = float(self._effective_memory_mb * 1024 * 1024)
        return bundle

    async def _place_on_restore_node(self) -> bool:
        """A placement group on `ray_restore_node` (where the snapshot is), if that node has
        room within PLACED_SOON_SEC; else nothing held, and False."""
        from ray.exceptions import RayError
        from ray.util.placement_group import placement_group, remove_placement_group

        assert self._restore_node is not None
        labels = {**self._ray_labels, NODE_ID_LABEL: self._restore_node}
        try:
            group = await asyncio.to_thread(
                functools.partial(
                    placement_group,
                    [self._bundle()],
                    strategy="STRICT_PACK",
                    bundle_label_selector=[labels],
                )
            )
            try:
                await asyncio.wait_for(group.ready(), PLACED_SOON_SEC)
            except TimeoutError:
                await asyncio.to_thread(remove_placement_group, group)
                return False
        except RayError:
            return False  # the placement below says what is wrong
        self._group = group
        await self._placed()
        return True

    async def _placed(self) -> None:
        """The node the placement group holds, and its host."""
        from ray.util.placement_group import placement_group_table

        table = await asyncio.to_thread(placement_group_table, self._group)
        self._node_id = str(table["bundles_to_node_id"][0])
        self._host, self._node = await asyncio.to_thread(_host_on, self._node_id)
        self.logger.info(
            "task %s: its container runs on Ray node %s", self.environment_name, self._node
        )

    async def _place(self) -> None:
        """A placement group holding the task's resources on a node with the labels asked
        for (the node of the snapshot it restores, where that has room), and that node's
        host."""
        from ray.exceptions import RayError
        from ray.util.placement_group import placement_group

        if self._restore_node is not None and await self._place_on_restore_node():
            return
        bundle = self._bundle()
        labels = f" with labels {self._ray_labels}" if self._ray_labels else ""
        biggest = await asyncio.to_thread(_biggest_node, self._ray_labels)
        if biggest is not None and any(biggest.get(k, 0.0) < v for k, v in bundle.items()):
            raise EnvironmentHostUnavailable(
                f"task {self.environment_name}: no Ray node{labels} can ever hold {_said(bundle)}"
                f": the biggest offers {_said(biggest)}; ask for less (ray_cpus, the task's "
                "memory_mb) or bigger nodes (`harbor-hpc ray up --cpus-per-node`, "
                "`--mem-per-node`)"
            )
        trial_dir = self.trial_paths.trial_dir
        try:
            # Each a call to the GCS, which may be slow or gone: never on the event loop.
            self._group = await asyncio.to_thread(
                functools.partial(
                    placement_group,
                    [bundle],
                    strategy="STRICT_PACK",
                    bundle_label_selector=[self._ray_labels] if self._ray_labels else None,
                )
            )
            try:
                await asyncio.wait_for(self._group.ready(), PLACED_SOON_SEC)
            except TimeoutError:  # the others hold the nodes: say so while it waits
                say_waiting(trial_dir, f"waiting for a Ray node{labels} with room for "
                            f"{_said(bundle)}")  # fmt: skip
                await asyncio.wait_for(
                    self._group.ready(), max(0.0, self._placement_timeout - PLACED_SOON_SEC)
                )
            finally:
                say_waiting(trial_dir, None)
            await self._placed()
        except RayError as exc:  # before TimeoutError: Ray's own timeouts are both
            raise EnvironmentHostUnavailable(
                f"task {self.environment_name}: the Ray cluster did not place it: "
                f"{_first_sentence(exc)}"
            ) from None
        except TimeoutError:
            raise EnvironmentHostUnavailable(
                f"task {self.environment_name}: no Ray node{labels} had room for "
                f"{bundle} within {self._placement_timeout:g} s; `harbor-hpc ray status` "
                "shows what is free (ray_cpus reserves less per environment)"
            ) from None

    async def _fetch(self, path: str) -> str:
        """The copy on this environment's node of the snapshot `path` on `ray_restore_node`
        (fetched by this node's host from that node's, once for every restore here)."""
        assert self._restore_node is not None and self._node_id is not None
        copies = _fetched.setdefault(path, {})
        if self._node_id not in copies:
            source, address = await asyncio.to_thread(_host_on, self._restore_node)
            self.logger.info(
                "task %s: its snapshot is on %s, which had no room: copied to %s",
                self.environment_name,
                address,
                self._node,
            )
            scratch = self._forwarded.get("scratch_dir")
            limit = self._forwarded.get("snapshot_storage_mb")
            copies[self._node_id] = asyncio.ensure_future(
                self._call(
                    "fetch_snapshot", source, path, Path(scratch) if scratch else None, limit
                )
            )
        try:
            copy: str = await asyncio.shield(copies[self._node_id])
        except Exception:
            copies.pop(self._node_id, None)  # the next restore here tries again
            raise
        return copy

    @override
    async def start(self, force_build: bool) -> None:
        await asyncio.to_thread(connect, self._ray_address, self._cluster_dir)
        try:
            await self._place()
            kwargs = self._forwarded
            restore = kwargs.get("restore_from")
            if restore is not None and self._restore_node not in (None, self._node_id):
                kwargs = {**kwargs, "restore_from": await self._fetch(str(restore))}
            spec = EnvironmentSpec(
                environment_dir=self.environment_dir,
                environment_name=self.environment_name,
                session_id=self.session_id,
                task_env_config=self.task_env_config,
                kwargs=kwargs,
            )
            branch = await self._call("start", self._id, spec, force_build)
            if branch is not None:
                write_branch(self.trial_paths.trial_dir, branch)
            await self.ensure_dirs(self._mount_targets(writable_only=True))
        except BaseException:
            await self.stop(delete=True)
            raise

    # -- snapshots and forks ---------------------------------------------------------------

    async def restorable(self, step: int | None = None) -> Restorable:
        """A snapshot of the container, taken on its node (`SingularityEnvironment.snapshot`)
        and held there, as the kwargs that start an environment from it: `restore_from`, and
        `ray_restore_node`, that node (a restore goes there, or copies it where it goes)."""
        if self._host is None or self._node_id is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        path = await self._call("snapshot", self._id, step, self.trial_paths.trial_dir)
        host, node = self._host, self._node_id

        async def release() -> None:
            # The copies fetched to other nodes (`_fetch`), then the snapshot on its own.
            for other, fetching in _fetched.pop(path, {}).items():
                with contextlib.suppress(Exception):
                    copy = await fetching
                    other_host, _ = await asyncio.to_thread(_host_on, other)
                    other_host.call.remote(uuid.uuid4().hex, "release_snapshot", copy)
            if self._host is host:
                await self._call("release_snapshot", path)
            else:  # the parent stopped meanwhile: its host is asked, unanswered
                host.call.remote(uuid.uuid4().hex, "release_snapshot", path)

        kwargs = {"restore_from": path, "ray_restore_node": node}
        return Restorable(kwargs, release)

    async def fork(self, count: int, step: int | None = None) -> list[RaySingularityEnvironment]:
        """`count` started copies of this environment as it is now, on its node where it has
        room (each its own placement group), else on another, the copy sent there: the parent
        goes on unchanged, and no child sees another's writes. As
        `SingularityEnvironment.fork`."""
        if count < 1:
            raise ValueError(f"count={count}: at least 1")
        taken = await self.restorable(step)
        try:
            return await started_all([self._child(taken) for _ in range(count)])
        finally:
            await taken.release()  # each child holds the copy now

    def _child(self, taken: Restorable) -> RaySingularityEnvironment:
        paths, session_id = fork_trial(self.trial_paths, self.session_id)
        return type(self)(
            session_id=session_id, trial_paths=paths, **self._made_with, **taken.kwargs
        )

    # -- exec -------------------------------------------------------------------------------

    @override
    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        if self._host is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        request = ExecRequest(
            self._id, command, cwd, self._merge_env(env), timeout_sec, self._resolve_user(user)
        )
        stdout, stderr, code = await self._call("exec", request, timeout_sec=timeout_sec)
        callback = self._output_callback()
        if callback is not None:  # the output as a whole: it is not streamed from the node
            for text, stream in ((stdout, "stdout"), (stderr, "stderr")):
                if text:
                    await callback(text, stream)
        return ExecResult(stdout=stdout, stderr=stderr, return_code=code)

    # -- files -------------------------------------------------------------------------

    def _transfer_id(self) -> str:
        return f"{self._id}.{uuid.uuid4().hex}"

    async def _send(self, source: IO[bytes], target: str, is_dir: bool) -> None:
        """`source` to the host in chunks, the last one with the call that places it."""
        if self._host is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        transfer = self._transfer_id()
        chunk = await asyncio.to_thread(source.read, CHUNK_BYTES)
        offset = 0
        while True:
            following = await asyncio.to_thread(source.read, CHUNK_BYTES)
            if not following:
                break
            await self._call("put", transfer, offset, chunk)
            offset += len(chunk)
            chunk = following
        await self._call("upload", self._id, transfer, offset, chunk, target, is_dir)

    async def _receive(
        self, source: str, is_dir: bool, into: IO[bytes], service: str | None = None
    ) -> None:
        if self._host is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        host, transfer = self._host, self._transfer_id()
        await self._call("download", self._id, transfer, source, is_dir, service)
        offset = 0
        while True:
            chunk = await self._ask(functools.partial(host.take.remote, transfer, offset))
            await asyncio.to_thread(into.write, chunk)
            offset += len(chunk)
            if len(chunk) < CHUNK_BYTES:
                break
        await self._ask(functools.partial(host.forget.remote, transfer))

    @override
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        with Path(source_path).open("rb") as source:
            await self._send(source, target_path, is_dir=False)

    @override
    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        with tempfile.TemporaryFile() as archive:
            await asyncio.to_thread(pack, Path(source_dir), archive)
            archive.seek(0)
            await self._send(archive, target_dir, is_dir=True)

    @override
    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        await self.service_download_file(source_path, target_path)

    @override
    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await self.service_download_dir(source_dir, target_dir)

    # -- compose services (Harbor's per-service operations, on the node's pod) ----------------

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
        if self._host is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        # As Harbor's compose providers: a service's exec takes nothing of main's defaults.
        request = ExecRequest(self._id, command, cwd, env, timeout_sec, user, service)
        stdout, stderr, code = await self._call("exec", request, timeout_sec=timeout_sec)
        return ExecResult(stdout=stdout, stderr=stderr, return_code=code)

    @override
    async def service_download_file(
        self, source_path: str, target_path: Path | str, *, service: str | None = None
    ) -> None:
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as into:
            await self._receive(source_path, False, into, service)

    @override
    async def service_download_dir(
        self, source_dir: str, target_dir: Path | str, *, service: str | None = None
    ) -> None:
        with tempfile.TemporaryFile() as archive:
            await self._receive(source_dir, True, archive, service)
            archive.seek(0)
            await asyncio.to_thread(unpack, archive, Path(target_dir))

    @override
    async def stop_service(self, service: str) -> None:
        if self._host is None:
            raise RuntimeError(f"task {self.environment_name}: the environment is not started")
        await self._call("stop_service", self._id, service)

    # -- stop ---------------------------------------------------------------------------

    @override
    async def stop(self, delete: bool) -> None:
        try:
            if self._host is not None and not self._lost:
                try:
                    await self._call("stop", self._id, delete, timeout_sec=STOP_TIMEOUT_SEC)
                except EnvironmentHostUnavailable as exc:
                    self.logger.warning("%s; nothing left to stop there", exc)
        finally:
            self._host = None
            group, self._group = self._group, None
            if group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    await asyncio.wait_for(
                        asyncio.to_thread(remove_placement_group, group), LIVENESS_SEC
                    )
                except Exception as exc:  # the cluster may be gone: nothing is held then
                    self.logger.debug("placement group not removed: %s", exc)


# A placement not ready within this is waiting for room, which the trial's folder then says.
PLACED_SOON_SEC = 2.0


def _biggest_node(labels: dict[str, str]) -> dict[str, float] | None:
    """The most CPUs and memory any alive node (with `labels`, Ray's selector) of the cluster
    offers in all, whatever it holds now; None when Ray does not say (the placement then waits
    as asked)."""
    import ray

    try:
        known: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    except Exception:  # Ray's own RPC errors: the placement says more
        return None
    fitting = [
        node
        for node in known
        if node.get("Alive")
        and all(_label_matches(node.get("Labels") or {}, k, v) for k, v in labels.items())
    ]
    if not fitting:
        return None  # Ray's own selector (with its `!`) judges labels it knows better
    return {
        key: max(float((node.get("Resources") or {}).get(key, 0.0)) for node in fitting)
        for key in ("CPU", "memory")
    }


def _label_matches(have: dict[str, str], key: str, value: str) -> bool:
    return have.get(key) != value[1:] if value.startswith("!") else have.get(key) == value


def _said(resources: dict[str, float]) -> str:
    """`1 CPU, 512 MB`."""
    cpus = resources.get("CPU", 0.0)
    memory = resources.get("memory", 0.0) / (1 << 20)
    return f"{cpus:g} CPU" + (f", {memory:.0f} MB" if memory else "")
