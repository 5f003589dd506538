"""`build`: one image per distinct build context, by Docker here, Apptainer here, or Apptainer
on Slurm nodes.

`choose` says which builder a request takes (and why), `plan` groups the tasks by context and
checks what that builder needs, and `run` makes what is missing through the backend it chose,
recording each image in the manifest as it ends (`images.build.run_build`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from harbor_hpc.core.config import default_cache_dir
from harbor_hpc.core.errors import InputError
from harbor_hpc.images.build import BuildPreview, parse_build_args, plan_build, run_build
from harbor_hpc.images.engine import BuilderKind, choose_builder
from harbor_hpc.slurm.build import SLURM_MEM_MB
from harbor_hpc.slurm.cluster import SlurmPlacement, UnitArray
from harbor_hpc.tasks.manifest import load_manifest

if TYPE_CHECKING:
    from collections.abc import Callable

    from harbor_hpc.images.build import BuildPlan, BuildResult, ImageOutcome, ProgressCallback

# A Docker build's images at once, and an Apptainer build's here.
JOBS = 2


@dataclass(frozen=True)
class BuildRequest:
    """One `build` of the tasks under `tasks_dir`, recorded in `manifest`."""

    tasks_dir: Path
    manifest: Path
    builder: BuilderKind = BuilderKind.AUTO
    # Docker builds: REGISTRY/NAMESPACE to push to, and whether to push at all.
    registry: str | None = None
    push: bool = True
    # Apptainer builds: the .sif store (None: the default one) and where builds unpack.
    cache_dir: Path | None = None
    scratch_dir: Path | None = None
    nohttps: bool | None = None
    jobs: int = JOBS
    # `NAME=VALUE` for the Dockerfiles' ARGs (harbor-hpc.toml's first; a later NAME wins).
    build_args: list[str] = field(default_factory=list)
    # Apptainer builds on compute nodes, one array element per context (`mem_mb` each), where
    # `slurm` says.
    slurm: SlurmPlacement | None = None
    mem_mb: int = SLURM_MEM_MB
    array_parallelism: int | None = None
    CONFIGURED: ClassVar[tuple[str, ...]] = (
        "manifest",
        "registry",
        "cache_dir",
        "scratch_dir",
        "nohttps",
        "jobs",
        "build_args",
        "array_parallelism",
    )

    @property
    def store(self) -> Path:
        """The .sif store Apptainer builds go into."""
        return self.cache_dir or default_cache_dir()


def choose(request: BuildRequest) -> tuple[BuilderKind, str]:
    """The builder `request` takes and why: `--slurm` builds with Apptainer on the nodes,
    `auto` takes Docker where an engine answers."""
    if request.slurm is not None:
        if request.builder is BuilderKind.DOCKER:
            raise InputError(
                "--slurm builds with Apptainer on compute nodes, which have no Docker",
                hint="build with --builder apptainer --slurm, or with Docker here without --slurm",
            )
        return BuilderKind.APPTAINER, "--slurm: compute nodes build with Apptainer"
    return choose_builder(request.builder)


@dataclass(frozen=True)
class PlannedBuild:
    """A request, the builder it takes and its plan: what `run` makes, what `--dry-run` shows."""

    request: BuildRequest
    builder: BuilderKind
    plan: BuildPlan

    def preview(self) -> BuildPreview:
        manifest = self.request.manifest
        return BuildPreview(self.plan, load_manifest(manifest) if manifest.exists() else None)


def plan(request: BuildRequest, builder: BuilderKind) -> PlannedBuild:
    """The tasks grouped by build context, for `builder` (`choose`); reads only."""
    registry = None
    if builder is BuilderKind.DOCKER:
        registry = request.registry
        if not registry:
            raise InputError(
                "no registry given",
                hint="pass --registry REGISTRY/NAMESPACE, or build into the .sif store without "
                "Docker: --builder apptainer",
            )
    planned = plan_build(
        request.tasks_dir,
        registry,
        jobs=request.jobs,
        build_args=parse_build_args(request.build_args),
    )
    return PlannedBuild(request, builder, planned)


def run(
    planned: PlannedBuild,
    *,
    on_progress: ProgressCallback | None = None,
    on_done: Callable[[ImageOutcome], None] | None = None,
    on_submitted: Callable[[UnitArray], None] | None = None,
) -> BuildResult:
    """Make every planned image not yet made, through the chosen backend."""
    from harbor_hpc.containers.builder import ApptainerBuilder
    from harbor_hpc.images.build import Builder
    from harbor_hpc.images.docker_builder import DockerBuilder
    from harbor_hpc.slurm.build import SlurmBuilder, build_on_slurm

    request, plan_ = planned.request, planned.plan
    backend: Builder
    if planned.builder is BuilderKind.DOCKER:
        backend = DockerBuilder(plan_, push=request.push, nohttps=bool(request.nohttps))
    elif request.slurm is not None:
        slurm_builder = SlurmBuilder(
            request.store,
            request.manifest,
            request.slurm,
            build_args=plan_.build_args,
            nohttps=request.nohttps,
            scratch=request.scratch_dir,
            mem_mb=request.mem_mb,
            array_parallelism=request.array_parallelism,
            on_submitted=on_submitted,
        )
        return build_on_slurm(
            plan_, request.manifest, slurm_builder, on_progress=on_progress, on_done=on_done
        )
    else:
        backend = ApptainerBuilder(
            request.store,
            build_args=plan_.build_args,
            nohttps=request.nohttps,
            scratch=request.scratch_dir,
        )
    return run_build(
        plan_,
        request.manifest,
        backend,
        jobs=request.jobs,
        on_progress=on_progress,
        on_done=on_done,
    )
