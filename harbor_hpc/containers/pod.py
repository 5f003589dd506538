"""A compose task's services beside its main container: one pod, as an ordinary user.

Each service (tasks/compose.py) is a container of its own (container.py: its image, overlay,
command server) that joins the main container's user and network namespaces (`nsenter`; its
root is mounted in the environment's own namespaces, holder.py, where the main container's is):
it is root there as the main container is, shares its loopback (service names resolve to
127.0.0.1 in every /etc/hosts of the pod), its network of its own and whatever network policy
holds there. Where the main container shares the node's network, so do its services. Its image is
an `image:` reference, converted into the .sif store as `convert` does, or a `build:` context,
found in the store under the name `build --builder apptainer` gives it (`env-<context hash>.sif`)
and built there first when missing, as `docker compose up` builds a missing image.

A service runs its ENTRYPOINT and command (the compose file's, else the image's) in the
background, as its user, in its working directory, with the image's ENV and its `environment`;
`depends_on` conditions are waited for: started (and settled, container.py), healthy (its
healthcheck, Docker's interval, timeout, retries and start period), completed successfully.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Sequence
from pathlib import Path

from harbor_hpc.containers.builder import ApptainerBuilder, sif_name
from harbor_hpc.containers.container import Container
from harbor_hpc.containers.errors import ContainerStartFailed, ImageUnavailable
from harbor_hpc.containers.sif import ImageConfig, image_config
from harbor_hpc.containers.store import checked_sif, ensure_sif, is_ready, sif_file
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.images.build import ImageFailed, PlannedImage
from harbor_hpc.images.context import context_hash
from harbor_hpc.images.reference import Reference
from harbor_hpc.runtimes.apptainer import apptainer_here
from harbor_hpc.tasks.compose import Healthcheck, HealthProbe, Service, health_argv
from harbor_hpc.tasks.manifest import ImageRecord


def service_sif(
    service: Service, environment_dir: Path, store: Path, *, nohttps: bool | None
) -> Path:
    """The .sif of `service`'s image, made ready in `store` when it is not there yet: its
    `image:`, else, or where that cannot be had, its `build:` context. Beside a `build:`, an
    `image:` only names what the build makes (`docker compose up` builds it), unless it is what
    `rewrite` pins a built context to: a .sif, or a reference pinned by digest.
    Raises ImageUnavailable naming the service."""
    where = f"service {service.name!r}"
    image = service.image
    if image is not None and service.build is not None:
        image = image if image.endswith(".sif") or "@sha256:" in image else None
    if image is not None:
        try:
            own = sif_file(image, environment_dir)
            if own is not None:
                return checked_sif(own, nohttps=nohttps)
            return ensure_sif(image, store, nohttps=nohttps)
        except HarborHpcError as exc:
            if service.build is None:
                hint = f" ({exc.hint})" if exc.hint else ""
                raise ImageUnavailable(f"{where}: {image}: {exc.message}{hint}") from exc
    assert service.build is not None
    try:
        context = context_hash(service.build)
        final = store.expanduser().absolute() / sif_name(context)
        if is_ready(final):
            return final
        if not apptainer_here():  # an enroot cluster's node: nothing builds a Dockerfile here
            raise ImageUnavailable(
                f"{where}: its build context {service.build} is not in {store}, and this node "
                "has no Apptainer to build it: build the task's images where Docker or Apptainer "
                "is (`harbor-hpc build`), then `convert` and `rewrite --sif`"
            )
        builder = ApptainerBuilder(store, build_args={}, nohttps=nohttps)
        builder.check_here()
        planned = PlannedImage(context, Reference("", f"env-{context[:12]}"), service.build)
        log = store.expanduser().absolute() / ".build-logs" / f"env-{context[:12]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        builder.make(planned, ImageRecord(planned.name, context), log, lambda _: None)
        return final
    except (HarborHpcError, ImageFailed, OSError) as exc:
        why = exc.message if isinstance(exc, HarborHpcError) else str(exc)
        raise ImageUnavailable(
            f"{where}: its build context {service.build} could not be built into {store}: {why}"
        ) from exc


def image_healthcheck(image: ImageConfig, where: str) -> Healthcheck | None:
    """The image's HEALTHCHECK (its OCI config's `Healthcheck`, durations in ns), or None."""
    raw = image.healthcheck
    if not raw:
        return None
    test = raw.get("Test") or []
    if test == ["NONE"]:
        return Healthcheck(disabled=True)

    def seconds(key: str) -> float | None:
        return raw[key] / 1e9 if raw.get(key) else None

    return Healthcheck(
        health_argv(test, where) if test else None,
        seconds("Interval"),
        seconds("Timeout"),
        raw.get("Retries") or None,
        seconds("StartPeriod"),
    )


class Sidecar:
    """One compose service, running in the pod (see the module docstring)."""

    def __init__(
        self, service: Service, task: str, private: Path, sif: Path, logger: logging.Logger
    ) -> None:
        self.service = service
        image = image_config(sif) or ImageConfig()
        self.container = Container(
            f"task {task}, service {service.name}", private, sif, image, logger
        )
        self.logger = logger
        self._exit: Path | None = None
        self._log: Path | None = None

    @property
    def name(self) -> str:
        return self.service.name

    @property
    def workdir(self) -> str:
        return self.service.working_dir or self.container.image.workdir or "/"

    def argv(self) -> list[str]:
        """What Docker runs: the entrypoint, then the command (the image's CMD only where the
        compose file does not set an entrypoint of its own)."""
        image = self.container.image
        entrypoint = (
            self.service.entrypoint if self.service.entrypoint is not None else image.entrypoint
        )
        if self.service.command is not None:
            command: Sequence[str] = self.service.command
        else:
            command = image.cmd if self.service.entrypoint is None else ()
        return [*entrypoint, *command]

    async def start(
        self,
        flags: Sequence[str],
        binds: Sequence[str],
        *,
        join: int | None,
    ) -> None:
        """Launch the container and its command: in the pod's user and network namespaces where
        `join` (the host pid of the main container's server) is given, its root mounted in its
        holder's namespaces where it has one."""
        env = {**self.container.image.env, **self.service.environment}
        self.container.stage(env)
        options = ["--uts", "--hostname", self.name, *binds]
        if self.container.holder is not None:
            await self.container.mount_root(options)
        command = self.container.command(
            flags, self.workdir, own_network=False, options=options, net_of=join
        )
        if join is not None and self.container.holder is None:
            enter = ["nsenter", "-t", str(join), "-U", "-n", "--preserve-credentials", "--"]
            command = [*enter, *command]
        await self.container.launch(command)
        argv = self.argv()
        if not argv:
            raise ContainerStartFailed(
                f"{self.container.name}: no command to run (image or compose)"
            )
        self._log, self._exit = await self.container.start_background(
            argv, "service", cwd=self.workdir, user=self.service.user
        )

    def exit_status(self) -> int | None:
        """The service's command's exit status once it ended, else None."""
        if self._exit is None or not self._exit.exists():
            return None
        text = self._exit.read_text().strip()
        return int(text) if text.lstrip("-").isdigit() else None

    def log_tail(self) -> str:
        if self._log is None or not self._log.exists():
            return ""
        return self._log.read_text(errors="replace")[-2000:]

    async def reach(self, condition: str) -> None:
        """Wait until the service is `condition` (a compose depends_on condition)."""
        if condition == "service_healthy":
            await self._healthy()
        elif condition == "service_completed_successfully":
            while (status := self.exit_status()) is None:
                await asyncio.sleep(0.1)
            if status != 0:
                self._fail(f"exited with {status}")
        else:
            await self.container.settle()

    def healthcheck(self) -> HealthProbe | None:
        """The compose file's healthcheck over the image's HEALTHCHECK, as Docker merges them."""
        image = image_healthcheck(self.container.image, self.container.name)
        return (self.service.healthcheck or Healthcheck()).over(image)

    async def _healthy(self) -> None:
        check = self.healthcheck()
        if check is None:
            self._fail("is waited for as service_healthy but has no healthcheck")
            return
        loop = asyncio.get_running_loop()
        started = loop.time()
        failures = 0
        while True:
            if await self._probe(check):
                return
            if self.exit_status() is not None:
                self._fail(f"exited with {self.exit_status()} before it was healthy")
            if loop.time() - started >= check.start_period_sec:
                failures += 1
                if failures >= check.retries:
                    self._fail(f"is unhealthy after {failures} healthchecks")
            await asyncio.sleep(check.interval_sec)

    async def _probe(self, check: HealthProbe) -> bool:
        script = self.container.script(shlex.join(check.test), None, None, self.service.user)
        try:
            output = await self.container.run(script, timeout_sec=max(1, int(check.timeout_sec)))
        except RuntimeError:
            return False
        return output.exit_code == 0

    def _fail(self, why: str) -> None:
        raise ContainerStartFailed(f"{self.container.name} {why}:\n{self.log_tail()}")
