"""What runs the containers on a Ray node: one `EnvironmentHost` actor per node and driver.

A host is a Ray actor (made by `harbor_hpc.ray.environment`, pinned to its node, owned by the
driver that asked for it, so it ends with that driver) holding that driver's environments on
the node: each a `SingularityEnvironment`, with the same fidelity, store and memory watchdog
as one started locally. One process serves every container of the node, as a local fleet is
served, instead of a Python process per container. The driver reaches them by their id.

Files cross in chunks (`CHUNK_BYTES`), a folder as an uncompressed tar: neither side ever
holds more than a chunk of a big folder in memory, and each chunk is one Ray call. What is
in transit waits in the host's private folder (0700, on the node's scratch space).

Every call that changes something goes through `call` with an id of the driver's: Ray answers
a call whose connection broke with `ActorUnavailableError` ("the task may or may not have been
executed"), and the driver, once the host answers again, asks again with the same id. The host
runs each id once and hands a repeated one the first run's outcome, so that no container starts
twice and no command runs twice. Reads (`take`) and the probe (`where`) are safe to repeat.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import socket
import tarfile
import tempfile
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from harbor.environments.base import transfer_tar_filter
from harbor.models.task.config import EnvironmentConfig, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.errors import ContainerStartFailed
from harbor_hpc.containers.probes import missing_subid_ranges
from harbor_hpc.containers.snapshot import Snapshot, live_snapshot, pack_layers, unpack_layers

# One Ray call's worth of a transfer: big enough that a folder of gigabytes is a few hundred
# calls, small enough that neither side notices holding it.
CHUNK_BYTES = 8 << 20
# The host's methods `call` runs once per id, and how many finished outcomes it keeps for a
# driver that asks again (a command's output at most: transfers return nothing).
ONCE = frozenset(
    {
        *("start", "exec", "set_network_policy", "stop_service", "put", "upload", "download"),
        *("snapshot", "pack_snapshot", "fetch_snapshot", "release_snapshot", "stop"),
    }
)
KEEP_OUTCOMES = 256


@dataclass(frozen=True)
class EnvironmentSpec:
    """What a host needs to make an environment: the task's, and the user's kwargs."""

    environment_dir: Path
    environment_name: str
    session_id: str
    task_env_config: EnvironmentConfig
    kwargs: dict[str, Any] = field(default_factory=dict)


class ExecRequest(NamedTuple):
    """A command for one environment, as one argument of the call: Ray serializes each
    argument on its own, and six cost a concurrent call a fifth more than one."""

    env_id: str
    command: str
    cwd: str | None
    env: dict[str, str] | None
    timeout_sec: int | None
    user: str | int | None
    # A compose service of the environment's pod; None: its main container.
    service: str | None = None


def pack(source: Path, archive: BinaryIO) -> None:
    """`source` (a folder) as an uncompressed tar, symlinks kept as links."""
    with tarfile.open(fileobj=archive, mode="w|") as tar:
        tar.add(source, arcname=".")


def unpack(archive: BinaryIO, target: Path) -> None:
    """A tar from `pack` into `target`, through Harbor's own filter for archives that come
    out of a container (no paths outside `target`, no device files)."""
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=archive, mode="r|") as tar:
        tar.extractall(target, filter=transfer_tar_filter)


class EnvironmentHost:
    """The Ray actor class (wrapped by `ray.remote` where it is started: this module does not
    import Ray). Every method names the environment it is for."""

    def __init__(self) -> None:
        self._environments: dict[str, SingularityEnvironment] = {}
        self._dir = Path(tempfile.mkdtemp(prefix="harbor-hpc-ray-host-"))  # 0700
        self._logger = logging.getLogger("harbor_hpc.ray.host")
        self._calls: OrderedDict[str, asyncio.Task[Any]] = OrderedDict()
        # The snapshots the driver holds (`snapshot`), by folder, until it lets go of them.
        self._snapshots: dict[str, Snapshot] = {}

    async def call(self, call_id: str, method: str, *args: Any) -> Any:
        """`method(*args)`, run once for `call_id`: asked again (the driver lost the answer),
        the same run's outcome. Cancelled (the driver gave up on it), the run stops."""
        if method not in ONCE:
            raise ValueError(f"not a method of the host: {method}")
        running = self._calls.get(call_id)
        if running is None:
            running = asyncio.ensure_future(getattr(self, method)(*args))
            self._calls[call_id] = running
            finished = [key for key, task in self._calls.items() if task.done()]
            for key in finished[: max(0, len(self._calls) - KEEP_OUTCOMES)]:
                del self._calls[key]
        return await running

    async def where(self) -> str:
        """The node's name: the liveness probe, run in a thread of its own (the `probe`
        concurrency group), not queued behind the environments' calls."""
        return socket.gethostname()

    def _environment(self, env_id: str) -> SingularityEnvironment:
        environment = self._environments.get(env_id)
        if environment is None:
            raise RuntimeError(f"no environment {env_id} on {socket.gethostname()}: stopped?")
        return environment

    async def start(
        self, env_id: str, spec: EnvironmentSpec, force_build: bool
    ) -> dict[str, Any] | None:
        """Start the environment; where it branched, if it started from a snapshot."""
        if not spec.environment_dir.is_dir():
            raise ContainerStartFailed(
                f"task {spec.environment_name}: its environment folder {spec.environment_dir} "
                f"is not on the Ray node {socket.gethostname()}; keep datasets on a filesystem "
                "every node shares"
            )
        environment = SingularityEnvironment(
            environment_dir=spec.environment_dir,
            environment_name=spec.environment_name,
            session_id=spec.session_id,
            trial_paths=TrialPaths(self._dir / env_id),
            task_env_config=spec.task_env_config,
            logger=self._logger,
            **spec.kwargs,
        )
        self._environments[env_id] = environment
        try:
            await environment.start(force_build)
        except BaseException:
            del self._environments[env_id]
            raise
        return environment.branch

    async def set_network_policy(self, env_id: str, policy: NetworkPolicy) -> None:
        await self._environment(env_id).set_network_policy(policy)

    async def exec(self, request: ExecRequest) -> tuple[str | None, str | None, int]:
        result = await self._environment(request.env_id).service_exec(
            request.command,
            service=request.service,
            cwd=request.cwd,
            env=request.env,
            timeout_sec=request.timeout_sec,
            user=request.user,
        )
        return result.stdout, result.stderr, result.return_code

    async def snapshot(self, env_id: str, step: int | None, source: Path) -> str:
        """A snapshot of the environment's container, held for the driver: its folder, which
        environments started here with `restore_from` start from (`source`: the trial on the
        driver, which they name as their parent)."""
        taken = await self._environment(env_id).snapshot(step, source)
        self._snapshots[str(taken.path)] = taken
        return str(taken.path)

    async def pack_snapshot(self, path: str) -> dict[str, Any]:
        """The snapshot at `path` as one tar per layer, for another node's host to `take`
        (`fetch_snapshot`), and what it records."""
        taken = live_snapshot(Path(path))
        transfers = [f"snapshot-{uuid.uuid4().hex}" for _ in taken.layers]
        archives = [self._transfer(transfer) for transfer in transfers]
        try:
            await asyncio.to_thread(pack_layers, taken, archives, not missing_subid_ranges())
        except BaseException:
            for archive in archives:
                archive.unlink(missing_ok=True)
            raise
        finally:
            taken.release()
        return {
            "layers": transfers,
            "source": str(taken.source),
            "step": taken.step,
            "env": taken.env,
        }

    async def fetch_snapshot(
        self, source: Any, path: str, scratch: Path | None, limit_mb: int | None
    ) -> str:
        """A copy here (in `scratch`) of the snapshot at `path` that the host `source` of
        another node holds, held for the driver, within `limit_mb` for this host's snapshots
        (snapshot_storage_mb): its folder."""
        packed = await source.call.remote(uuid.uuid4().hex, "pack_snapshot", path)
        archives = []
        try:
            for transfer in packed["layers"]:
                archive = self._transfer(transfer)
                archives.append(archive)
                with archive.open("wb") as into:
                    offset = 0
                    while True:
                        chunk = await source.take.remote(transfer, offset)
                        into.write(chunk)
                        offset += len(chunk)
                        if len(chunk) < CHUNK_BYTES:
                            break
                await source.forget.remote(transfer)
            taken = await asyncio.to_thread(
                functools.partial(
                    unpack_layers,
                    archives,
                    scratch or Path(tempfile.gettempdir()),
                    source=Path(packed["source"]),
                    step=packed["step"],
                    env=packed["env"],
                    subids=not missing_subid_ranges(),
                    limit_bytes=limit_mb * 2**20 if limit_mb else None,
                )
            )
        finally:
            for archive in archives:
                archive.unlink(missing_ok=True)
        self._snapshots[str(taken.path)] = taken
        return str(taken.path)

    async def release_snapshot(self, path: str) -> None:
        taken = self._snapshots.pop(path, None)
        if taken is not None:
            taken.release()

    async def stop_service(self, env_id: str, service: str) -> None:
        await self._environment(env_id).stop_service(service)

    def _transfer(self, transfer_id: str) -> Path:
        return self._dir / f"{transfer_id}.part"

    async def put(self, transfer_id: str, offset: int, chunk: bytes) -> None:
        """A chunk of an upload at `offset`: all of them but its last."""
        part = self._transfer(transfer_id)
        with part.open("r+b" if part.exists() else "wb") as file:
            file.seek(offset)
            file.write(chunk)

    async def upload(
        self,
        env_id: str,
        transfer_id: str,
        offset: int,
        last_chunk: bytes,
        target: str,
        is_dir: bool,
    ) -> None:
        """The upload's last chunk (at `offset`), then its whole into the container at
        `target`."""
        environment = self._environment(env_id)
        await self.put(transfer_id, offset, last_chunk)
        part = self._transfer(transfer_id)
        staged = self._dir / transfer_id
        try:
            if is_dir:
                with part.open("rb") as archive:
                    await asyncio.to_thread(unpack, archive, staged)
                await environment.upload_dir(staged, target)
            else:
                await environment.upload_file(part, target)
        finally:
            part.unlink(missing_ok=True)
            shutil.rmtree(staged, ignore_errors=True)

    async def download(
        self, env_id: str, transfer_id: str, source: str, is_dir: bool, service: str | None
    ) -> None:
        """Take `source` out of the container (or the pod's compose `service`) into the host's
        folder (a folder as a tar), for `take` to hand over chunk by chunk."""
        environment = self._environment(env_id)
        part = self._transfer(transfer_id)
        if is_dir:
            staged = self._dir / transfer_id
            try:
                await environment.service_download_dir(source, staged, service=service)
                with part.open("wb") as archive:
                    await asyncio.to_thread(pack, staged, archive)
            finally:
                shutil.rmtree(staged, ignore_errors=True)
        else:
            await environment.service_download_file(source, part, service=service)

    async def take(self, transfer_id: str, offset: int) -> bytes:
        """The download's chunk at `offset` (a short one is its last); safe to ask again."""
        with self._transfer(transfer_id).open("rb") as archive:
            archive.seek(offset)
            return archive.read(CHUNK_BYTES)

    async def forget(self, transfer_id: str) -> None:
        """The download is over: its file goes."""
        self._transfer(transfer_id).unlink(missing_ok=True)

    async def stop(self, env_id: str, delete: bool) -> None:
        environment = self._environments.pop(env_id, None)
        # What a driver that gave up on a transfer left (transfer ids start with the env's).
        for part in self._dir.glob(f"{env_id}.*.part"):
            part.unlink(missing_ok=True)
        if environment is not None:
            await environment.stop(delete)
