"""What runs inside one array element: a chunk of task attempts, C Harbor trials at a time.

The worker is a submitit `Checkpointable`: when Slurm preempts the job or its time limit nears,
submitit requeues the same callable with the same chunk. Its state is on disk, not in memory:
before starting a unit it looks at the run's markers and result.json files and skips every unit
that already has a finished trial in this submission (or a successful one from any), so a
requeued element picks up where the killed one stopped and never runs a finished trial twice.
A trial that was cut off midway is started again under a new trial name.

An element whose trials ended then does what its submitter handed it (`then`: submit queues the
elements that wait under the user's limit on queued jobs, steps/submit/waves.py), so that a run
queued in waves goes on with nobody looking at it; what fails there is logged, never the
element's.

A run's submissions cancelled from Python (`cancel_submissions`: a trainer's batch deadline)
are seen within CANCEL_POLL_S: the worker marks its running trials cancelled, then cancels
them (Harbor stops each environment and records `CancelledError`) and starts no more.

litellm (terminus-2's model client) fetches its model cost map from the internet when it is
first imported, unless LITELLM_LOCAL_MODEL_COST_MAP says to use the copy it ships: on a node
without internet access every worker waited seconds for it (`use_local_cost_map`).

The agent's variables (`agent_env`) are in the job's environment: an agent that runs here
(terminus-2) finds them there, and only one that runs inside the container gets them there
(secrets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import submitit

from harbor_hpc.containers.errors import error_policy_overrides
from harbor_hpc.results.calls import recording_calls
from harbor_hpc.results.classify import AttemptState, FailureClass
from harbor_hpc.results.outcomes import RunTrials, note_outcome, read_outcome
from harbor_hpc.results.record import (
    CANCELLED,
    Marker,
    RunPaths,
    RunRecord,
    Unit,
    cancelled_through,
    load_run,
    new_trial_name,
    seal,
    write_marker,
)
from harbor_hpc.results.status import latest_markers
from harbor_hpc.slurm.secrets import redact_secrets_only, runs_in_container

log = logging.getLogger(__name__)

LOCAL_COST_MAP = "LITELLM_LOCAL_MODEL_COST_MAP"
CANCEL_POLL_S = 1.0


def use_local_cost_map() -> None:
    """Have litellm, once imported in this process (and its children), use the cost map it
    ships rather than fetch one, unless the user said otherwise in the environment. Workers call
    it before they import Harbor; submit before it imports the agent, so that the jobs it
    queues inherit it too."""
    os.environ.setdefault(LOCAL_COST_MAP, "True")


def agent_config_fields(record: RunRecord) -> dict[str, Any]:
    """Harbor's AgentConfig fields: a registered agent name, or `module:Class` for custom ones."""
    who = {"import_path": record.agent} if ":" in record.agent else {"name": record.agent}
    fields: dict[str, Any] = {**who, "model_name": record.model, "kwargs": record.agent_kwargs}
    if record.agent_env and runs_in_container(fields):
        # `${NAME}`: Harbor fills it in from this job's environment when the agent starts, and
        # writes the template, never the value, into the trial's config.json. An agent that
        # runs here finds them in this process's environment, and the container never sees
        # them (secrets.py).
        fields["env"] = {name: f"${{{name}}}" for name in record.agent_env}
    return fields


def current_job_id() -> str | None:
    try:
        job_id: str = submitit.JobEnvironment().job_id
        return job_id
    except RuntimeError:  # called outside a submitit job (tests, debugging)
        return None


class ChunkWorker(submitit.helpers.Checkpointable):
    """Runs `units` of the run in `run_dir` for submission number `submission`, then calls
    `then` with the run's folder (a module-level function: it is pickled with the worker)."""

    def __init__(
        self,
        run_dir: str,
        submission: int,
        concurrency: int,
        then: Callable[[Path], object] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.submission = submission
        self.concurrency = concurrency
        self.then = then
        self.terminated_by: str | None = None
        # The markers of the trials running now, by trial name (`_terminate` marks them).
        self._running: dict[str, Marker] = {}

    def __call__(self, units: list[list[Any]]) -> dict[str, int]:
        use_local_cost_map()
        run_dir = Path(self.run_dir)
        if cancelled_through(run_dir) >= self.submission:
            return {"units": len(units), "ran": 0}
        record = load_run(run_dir)
        todo = self.units_left(run_dir, record, [Unit.from_json(u) for u in units])
        self._watch_termination()
        asyncio.run(self._run_all(run_dir, record, todo))
        if self.then is not None and self.terminated_by is None:
            try:
                self.then(run_dir)
            except Exception:  # the trials ended as they did; status and --wait try it again
                log.warning("after the trials of %s", run_dir, exc_info=True)
        return {"units": len(units), "ran": len(todo)}

    def _watch_termination(self) -> None:
        """Note SIGTERM (scancel, node shutdown) so that trials it breaks are not blamed on the
        agent: Slurm signals every process of the job, containers included, and the trials
        then fail with whatever error the dying container caused."""
        self.terminated_by = None
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: FrameType | None) -> None:
            self._terminate(signal.Signals(signum).name)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_term)

    def _terminate(self, by: str) -> None:
        """Note what ends the job's trials (a signal, CANCELLED) in the marker of each one
        running that has not ended, before anything breaks it: Harbor writes a broken trial's
        result.json before its error reaches us, and a reader in between (a trainer's stream)
        must not take that result for the trial's own."""
        self.terminated_by = by
        run_dir = Path(self.run_dir)
        for marker in list(self._running.values()):
            if (
                marker.terminated_by is None
                and not (RunPaths(run_dir).trial(marker.trial) / "result.json").exists()
            ):
                marker.terminated_by = by
                write_marker(run_dir, marker)

    def units_left(self, run_dir: Path, record: RunRecord, units: list[Unit]) -> list[Unit]:
        trials = RunTrials(run_dir, reward_key=record.reward_key)
        newest = latest_markers(trials.markers)
        markers = {unit: newest[unit] for unit in units if unit in newest}
        outcomes = dict(zip(markers, trials.outcomes(markers.values()), strict=True))
        left = []
        for unit in units:
            marker, outcome = markers.get(unit), outcomes.get(unit)
            finished_here = (
                outcome is not None
                and marker is not None
                and record.counts(unit.task, marker.submission)  # not of a task since changed
                and outcome.failure is not FailureClass.INFRASTRUCTURE
                and (marker.submission == self.submission or outcome.state is AttemptState.DONE)
            )
            if not finished_here:
                left.append(unit)
        return left

    async def _run_all(self, run_dir: Path, record: RunRecord, units: list[Unit]) -> None:
        slots = asyncio.Semaphore(max(1, self.concurrency))

        async def run_one(unit: Unit) -> None:
            async with slots:
                if self.terminated_by is None:  # a dying job starts nothing new
                    await self._run_trial(run_dir, record, unit)

        trials = [asyncio.create_task(run_one(unit)) for unit in units]
        watch = asyncio.create_task(self._cancel_when_asked(run_dir, trials))
        try:
            await asyncio.gather(*trials, return_exceptions=True)
        finally:
            watch.cancel()

    async def _cancel_when_asked(self, run_dir: Path, trials: list[asyncio.Task[None]]) -> None:
        while cancelled_through(run_dir) < self.submission:
            await asyncio.sleep(CANCEL_POLL_S)
        self._terminate(CANCELLED)
        for trial in trials:
            trial.cancel()

    async def _run_trial(self, run_dir: Path, record: RunRecord, unit: Unit) -> None:
        # Harbor is imported here, in the job, so that submitting stays quick.
        from harbor.models.trial.config import (
            AgentConfig,
            EnvironmentConfig,
            TaskConfig,
            TrialConfig,
        )
        from harbor.trial.trial import Trial

        paths = RunPaths(run_dir)
        marker = Marker(
            trial=new_trial_name(unit.task, unit.attempt),
            task=unit.task,
            attempt=unit.attempt,
            submission=self.submission,
            job=current_job_id(),
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=datetime.now(UTC).isoformat(),
        )
        self._running[marker.trial] = marker
        write_marker(run_dir, marker)
        try:
            config = TrialConfig(
                task=TaskConfig(path=record.task_path(unit.task)),
                trial_name=marker.trial,
                trials_dir=paths.trials,
                agent=AgentConfig(**agent_config_fields(record)),
                environment=EnvironmentConfig(
                    import_path=record.environment, kwargs=record.environment_kwargs
                ),
                # Harbor's error policy knows our environment's failures by these names.
                override_error_policy=error_policy_overrides(),
            )
            redact_secrets_only()
            trial = await Trial.create(config)
            # Harbor has just made the trial's folders world-writable, for Docker's sake.
            seal(paths.trial(marker.trial), record.group_readable)
            # What the agent's model calls came to: the evidence of whose outcome it was.
            with recording_calls(paths.trial(marker.trial)):
                await trial.run()
            # A signal (scancel, shutdown) may have broken the trial's end whatever it recorded
            # (its marker says so); a cancel of the run that let the trial end by itself broke
            # nothing: it counts.
            if marker.terminated_by == CANCELLED:
                marker.terminated_by = None
                write_marker(run_dir, marker)
        except asyncio.CancelledError:
            # The run was cancelled: Harbor has stopped the environment and written result.json.
            marker.terminated_by = self.terminated_by or CANCELLED
            write_marker(run_dir, marker)
        except Exception as exc:
            # Harbor records failures inside trial.run in result.json; this is a failure before
            # it could (the environment refused the task, the agent name is unknown...).
            marker.error_type = type(exc).__name__
            marker.error_message = str(exc)
            marker.terminated_by = self.terminated_by  # maybe why it failed
            write_marker(run_dir, marker)
        finally:
            self._running.pop(marker.trial, None)
            seal(paths.trial(marker.trial), record.group_readable)
            self._note(run_dir, record, marker)

    @staticmethod
    def _note(run_dir: Path, record: RunRecord, marker: Marker) -> None:
        """Note what the trial came to in the run's outcomes index, now that nothing writes its
        files any more; a trial that has not ended (Harbor wrote no result) is not noted."""
        outcome = read_outcome(run_dir, record.reward_key, marker)
        if outcome is not None:
            with contextlib.suppress(OSError):  # a cache: readers fall back on the folder
                note_outcome(
                    run_dir,
                    marker,
                    outcome,
                    group_readable=record.group_readable,
                    reward_key=record.reward_key,
                )
