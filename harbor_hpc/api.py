"""harbor-hpc from Python: everything a trainer or a script uses, in one place.

    from harbor_hpc.api import RolloutRequest, run_rollouts, run_status, export

The names below are the supported surface (docs/python.md says what each does); every other
module is internal and may change. Like the CLI, the functions read harbor-hpc.toml for what
they are not given, and raise `HarborHpcError` (its `hint` says what to do, `exit_code` is the
CLI's) for what a user can cause.

- Run and read runs: `run_rollouts(RolloutRequest(...), progress=...)` is `submit --wait`
  plus `export`; `stream_rollouts(...)` yields each line as its attempt ends (`Progress`
  counts them); `cancel_run(run_dir)` stops what is left of a run; `run_status(run_dir)` is
  `status`; `export(run_dir, out, fmt=...)` is `export`;
  `rollout_lines(run_dir, run_status(run_dir).attempts, fmt=...)` the lines without a file;
  `trial_rollout(trial_dir, task_dir)` the line of one Harbor trial a trainer ran itself,
  whose agent's model calls `with recording_calls(trial_dir): await trial.run()` keeps as the
  evidence of whose outcome it was (docs/results.md, the validity rule).
- The Harbor environments, for a trainer that builds Harbor trials itself:
  `SingularityEnvironment` (the container beside the process) and `RaySingularityEnvironment`
  (the container on a Ray cluster's node; the `ray` extra).
- Sandboxes, for a trainer that drives the tools itself (TRL's `environment_factory`; TRL's
  own `HarborEnv` on them is `harbor_hpc.trl`): `SandboxPool(SandboxOptions(...))`, whose
  `open(task_dir)` gives a `Sandbox` (`exec`, `upload`, `download`, `verify()` -> a
  `SandboxResult`, `close`, `fork(n)`: n sandboxes branched off it, each result's `Branch`
  saying where; `a...` coroutines of each), `SandboxEnded` for a call on one that is gone
  (docs/python.md, "Sandboxes"); `snapshot()` gives a `SandboxSnapshot` to `restore(n)` from
  (`fork` is both). `Snapshot`: a live container's files, from
  `SingularityEnvironment.snapshot()`, restored by its `restore` (`fork` is both).
- The exceptions a trial or a call can end with: `HarborHpcError`, `InputError` (bad input;
  `TaskChangedError`, its kind for a run folder whose tasks changed since it ran them) and
  the environment's own, whose names `status` classifies (`MemoryLimitExceededError`,
  `EnvironmentHostUnavailable`, ...) and Harbor's error policy knows
  (`error_policy_overrides()`, for a `TrialConfig` a trainer makes itself).
- The steps the CLI runs, each a request and a function: `configured(ConvertRequest, ...)` is
  a request with harbor-hpc.toml filling in, exactly as the CLI's flags are filled in;
  `convert_images(request)` is `convert`; `submit_run(tasks, run_dir, configured_options(None,
  agent=...))` is `submit`, `resubmit_run(run_dir)` is `resubmit`; `BuildRequest` with
  `harbor_hpc.steps.build.choose/plan/run` is `build`. `SlurmPlacement` is where jobs go.
- Configuration: `load_config()`, the harbor-hpc.toml the CLI would read here.

Every function here raises errors in Python's words (fields and functions, not flags).
"""

import functools
from collections.abc import Callable

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.containers.errors import (
    ContainerDied,
    ContainerStartFailed,
    EnvironmentHostUnavailable,
    ImageUnavailable,
    MemoryLimitExceededError,
    SetupScriptFailed,
    SnapshotRefused,
    UnsupportedTask,
    error_policy_overrides,
)
from harbor_hpc.containers.snapshot import Snapshot
from harbor_hpc.core.config import Config, configured, load_config
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.ray.environment import RaySingularityEnvironment
from harbor_hpc.results import export as _export
from harbor_hpc.results.calls import recording_calls
from harbor_hpc.results.classify import AttemptState, FailureClass
from harbor_hpc.results.export import Export, ExportFormat
from harbor_hpc.results.rollout import trial_rollout
from harbor_hpc.results.status import AttemptStatus, RunStatus
from harbor_hpc.sandbox.pool import (
    Branch,
    Sandbox,
    SandboxEnded,
    SandboxOptions,
    SandboxPool,
    SandboxResult,
    SandboxSnapshot,
)
from harbor_hpc.slurm.cluster import SlurmPlacement
from harbor_hpc.steps import convert as _convert
from harbor_hpc.steps import runs as _runs
from harbor_hpc.steps.build import BuildRequest
from harbor_hpc.steps.convert import ConvertReport, ConvertRequest
from harbor_hpc.steps.rollouts import (
    Progress,
    RolloutRequest,
    python_words,
    run_rollouts,
    stream_rollouts,
)
from harbor_hpc.steps.submit import launch as _submit
from harbor_hpc.steps.submit.launch import SubmitResult, TaskChangedError
from harbor_hpc.steps.submit.options import SubmitOptions, configured_options


def _in_python_words[**P, R](function: Callable[P, R]) -> Callable[P, R]:
    """`function` as a Python caller meets it: its errors name fields and functions, not the
    command line's flags and commands (the CLI calls the steps themselves)."""

    @functools.wraps(function)
    def speaking_python(*args: P.args, **kwargs: P.kwargs) -> R:
        with python_words():
            return function(*args, **kwargs)

    return speaking_python


submit_run = _in_python_words(_submit.submit_run)
resubmit_run = _in_python_words(_submit.resubmit_run)
cancel_run = _in_python_words(_runs.cancel_run)
run_status = _in_python_words(_runs.run_status)
export = _in_python_words(_runs.export)
rollout_lines = _in_python_words(_export.rollout_lines)
convert_images = _in_python_words(_convert.convert_images)

__all__ = [
    "AttemptState",
    "AttemptStatus",
    "Branch",
    "BuildRequest",
    "Config",
    "ContainerDied",
    "ContainerStartFailed",
    "ConvertReport",
    "ConvertRequest",
    "EnvironmentHostUnavailable",
    "Export",
    "ExportFormat",
    "FailureClass",
    "HarborHpcError",
    "ImageUnavailable",
    "InputError",
    "MemoryLimitExceededError",
    "Progress",
    "RaySingularityEnvironment",
    "RolloutRequest",
    "RunStatus",
    "Sandbox",
    "SandboxEnded",
    "SandboxOptions",
    "SandboxPool",
    "SandboxResult",
    "SandboxSnapshot",
    "SetupScriptFailed",
    "SingularityEnvironment",
    "SlurmPlacement",
    "Snapshot",
    "SnapshotRefused",
    "SubmitOptions",
    "SubmitResult",
    "TaskChangedError",
    "UnsupportedTask",
    "cancel_run",
    "configured",
    "configured_options",
    "convert_images",
    "error_policy_overrides",
    "export",
    "load_config",
    "recording_calls",
    "resubmit_run",
    "rollout_lines",
    "run_rollouts",
    "run_status",
    "stream_rollouts",
    "submit_run",
    "trial_rollout",
]
