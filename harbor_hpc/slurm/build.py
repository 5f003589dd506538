"""`build --builder apptainer --slurm`: the contexts still to build as one Slurm array job, one
element per context, each built on a compute node as a local build builds it.

`SlurmBuilder` is a `Builder` that `run_build` drives like any other, so the rest is the local
build's: the plan recorded in the manifest, each image recorded under the manifest's lock as it
finishes, failures named per context (the RUN, its exit code, the log), a rerun making only what
is missing. Its `prepare` queues one element per context whose `env-<hash>.sif` is not yet in the
store; each element builds through `ApptainerBuilder` into the shared store and returns what it
made (the .sif and its sha256, or the error), which `make` hands back to `run_build` to record in
the submitting process: elements never write the manifest, so none can lose another's record.
One thread reads the elements' results as they come (`cluster.await_array`).

The store and the manifest's folder (where the build logs go) must be on a filesystem the nodes
share; scratch space is each node's own (`--scratch-dir`, else its APPTAINER_TMPDIR or TMPDIR).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from harbor_hpc.containers.builder import ApptainerBuilder, sif_name
from harbor_hpc.containers.store import is_ready
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.images.build import (
    BuildPlan,
    BuildResult,
    ImageAction,
    ImageFailed,
    ImageOutcome,
    PlannedImage,
    ProgressCallback,
    build_log,
    run_build,
)
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Executor, SlurmPlacement, UnitArray, unit_log_dir
from harbor_hpc.tasks.manifest import ImageRecord

if TYPE_CHECKING:  # submitit loads when the array is queued
    import submitit

# A build converts its base images, runs the RUN steps and packs the .sif (mksquashfs, which uses
# every core it gets); RUN steps that install or compile want more memory than a conversion.
SLURM_CPUS = 2
SLURM_MEM_MB = 8192
# The submitting process only waits for the elements: one thread each, up to this many.
WAITERS = 64


class SlurmBuilder(ApptainerBuilder):
    """Builds the contexts not yet in the store on compute nodes, as `ApptainerBuilder` does
    here (whose store, build args, plain HTTP and scratch the elements take)."""

    def __init__(
        self,
        store: Path,
        manifest: Path,
        placement: SlurmPlacement,
        *,
        build_args: dict[str, str],
        nohttps: bool | None = None,
        scratch: Path | None = None,
        mem_mb: int = SLURM_MEM_MB,
        array_parallelism: int | None = None,
        on_submitted: Callable[[UnitArray], None] | None = None,
    ) -> None:
        super().__init__(store, build_args=build_args, nohttps=nohttps, scratch=scratch)
        self.manifest = manifest
        self.request = cluster.unit_request(
            "harbor-hpc-build",
            placement,
            cpus=SLURM_CPUS,
            mem_mb=mem_mb,
            array_parallelism=array_parallelism,
        )
        # The folder asked for, if any: unset, each node takes its own scratch space.
        self.node_scratch = str(scratch) if scratch else None
        self.on_submitted = on_submitted
        self._results: dict[str, Future[cluster.Outcome]] = {}

    def prepare(self, plan: BuildPlan) -> None:
        cluster.require_sbatch(
            "--slurm", hint="run build on a login node of the cluster, or without --slurm"
        )
        super().prepare(plan)
        todo = [
            image
            for image in plan.images.values()
            if not is_ready(self.store / sif_name(image.context))
        ]
        if todo:
            self._submit(todo)

    def _submit(self, todo: list[PlannedImage]) -> None:
        """Queue one element per image of `todo`, and a thread that hands each its result."""
        log_dir = unit_log_dir(self.store)
        pool = cluster.executor(log_dir / "%j", Executor.SLURM, self.request)
        count = len(todo)
        # Registry credentials reach the nodes in the environment sbatch exports, never in the
        # job's script or its pickled arguments.
        jobs = cluster.submit_array(
            pool,
            build_one,
            todo,
            [str(build_log(self.manifest, image)) for image in todo],
            [str(self.store)] * count,
            [self.build_args] * count,
            [self.nohttps] * count,
            [self.node_scratch] * count,
            what="the build job",
            hint="check --partition, --account and --qos (`sinfo` lists the partitions)",
        )
        if self.on_submitted is not None:
            self.on_submitted(UnitArray(jobs[0].job_id.split("_")[0], count, log_dir))
        results = {job.job_id: Future[cluster.Outcome]() for job in jobs}
        self._results = {
            image.context: results[job.job_id] for image, job in zip(todo, jobs, strict=True)
        }
        waiter = threading.Thread(
            target=_hand_out, args=(jobs, results), name="build-results", daemon=True
        )
        waiter.start()

    def make(
        self, image: PlannedImage, record: ImageRecord, log: Path, progress: Callable[[str], None]
    ) -> ImageAction:
        result = self._results.get(image.context)
        if result is None:  # in the store when the array was queued
            return super().make(image, record, log, progress)
        record.sif = record.sif_sha256 = None
        progress("building on Slurm")
        outcome = result.result()
        if "error" in outcome:
            hint = outcome.get("hint")
            raise ImageFailed(outcome["error"] + (f" ({hint})" if hint else ""))
        record.sif, record.sif_sha256 = outcome["sif"], outcome["sif_sha256"]
        return ImageAction(outcome["action"])


def _hand_out(
    jobs: list[submitit.Job[cluster.Outcome]], results: dict[str, Future[cluster.Outcome]]
) -> None:
    """Each element's outcome to its image's future as it comes; whatever stops the waiting (a
    Slurm that no longer answers) fails those still waiting instead of leaving them waiting."""
    try:
        for job, outcome in cluster.await_array(jobs, retry="run build again to retry"):
            results[job.job_id].set_result(outcome)
    except Exception as exc:
        for result in results.values():
            if not result.done():
                result.set_exception(exc)


def build_one(
    image: PlannedImage,
    log: str,
    store: str,
    build_args: dict[str, str],
    nohttps: bool | None,
    scratch: str | None,
) -> cluster.Outcome:
    """One context built on a compute node into the store, as `build` builds it locally; a
    plain dict back, so it pickles to the submitting process, which records it."""
    builder = ApptainerBuilder(
        Path(store),
        build_args=build_args,
        nohttps=nohttps,
        scratch=Path(scratch) if scratch else None,
    )
    record = ImageRecord(image.repository, image.tag)
    try:
        builder.check_here()
        action = builder.make(image, record, Path(log), lambda text: None)
    except ImageFailed as exc:
        return {"error": str(exc)}
    except HarborHpcError as exc:
        return {"error": exc.message}
    return {"action": action, "sif": record.sif, "sif_sha256": record.sif_sha256}


def build_on_slurm(
    plan: BuildPlan,
    manifest: Path,
    builder: SlurmBuilder,
    *,
    on_progress: ProgressCallback | None = None,
    on_done: Callable[[ImageOutcome], None] | None = None,
) -> BuildResult:
    """`run_build` through `builder`, with a thread per image waiting for its element."""
    waiters = max(1, min(WAITERS, len(plan.images)))
    return run_build(
        plan, manifest, builder, jobs=waiters, on_progress=on_progress, on_done=on_done
    )
