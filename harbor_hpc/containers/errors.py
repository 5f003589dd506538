"""Why a trial failed inside our environment, as exception types Harbor records by name.

Harbor stores a failed trial's exception type and message in result.json (`exception_info`) and
decides by that name, in its error policy (`harbor/models/trial/error_policy.py`), whether the
trial is retried, graded, and whether its reward is valid. Where Harbor names the failure
(`MemoryLimitExceededError`, as its own Singularity environment does) ours carries that name;
the others are given to Harbor's table (`error_policy_overrides`) with the policy of the
failure Harbor's Docker environment raises for the same thing, so that `harbor run`, our runs
and every framework keyed on those names treat them alike. `harbor-hpc status` classifies
failures by these names too, so keep them stable.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harbor.models.trial.error_policy import ErrorPolicyOverride


class MemoryLimitExceededError(RuntimeError):
    """The memory watchdog killed the container: its message names the limit and the peak."""


class SetupScriptFailed(RuntimeError):
    """environment/files/setup.sh exited non-zero; the message carries its output."""


class ImageUnavailable(RuntimeError):
    """The task's image (a .sif path or a registry reference) could not be found or converted."""


class ContainerStartFailed(RuntimeError):
    """Apptainer could not start the container or its command server; its output follows."""


class ContainerDied(RuntimeError):
    """The container ended while the trial was using it, for a reason other than memory."""


class EnvironmentHostUnavailable(ContainerDied):
    """Nothing can run the container, or still runs it: its Ray node was lost, the process
    serving it there died, the cluster ended or never answered, or no node had room for it.
    The message names the node or the cluster."""


class SnapshotRefused(RuntimeError):
    """A snapshot or fork this container cannot give (its root is not one of our own, the
    process's snapshots are at their cap, the copy failed): the message says why."""


class UnsupportedTask(RuntimeError):
    """The task needs something this environment cannot give it faithfully (a compose feature
    one pod cannot honour, named in the message)."""


# Each of ours that Harbor's table does not name, and the Harbor failure whose policy it takes:
# the image could not be had as a sandbox that cannot be built; a start that failed as one that
# timed out; setup.sh as a failed healthcheck; a container (or its host) gone as a GKE pod gone;
# an unsupported task as per-service operations a provider cannot do (never retried).
HARBOR_EQUIVALENT: dict[str, str] = {
    ImageUnavailable.__name__: "SandboxBuildFailedError",
    ContainerStartFailed.__name__: "EnvironmentStartTimeoutError",
    SetupScriptFailed.__name__: "HealthcheckError",
    ContainerDied.__name__: "GKEPodNotFoundError",
    EnvironmentHostUnavailable.__name__: "GKEPodNotFoundError",
    UnsupportedTask.__name__: "ServiceOperationsUnsupportedError",
}


@functools.cache
def error_policy_overrides() -> dict[str, ErrorPolicyOverride]:
    """Our names for Harbor's error policy table, as `TrialConfig.override_error_policy` (and a
    job config's `override_error_policy`) takes them: each with its equivalent's policy. Made
    once (classifying a run asks for every failed trial); not to be changed by callers."""
    from harbor.models.trial.error_policy import ErrorPolicyOverride, policy_for

    overrides = {}
    for ours, harbors in HARBOR_EQUIVALENT.items():
        policy = policy_for(harbors)
        overrides[ours] = ErrorPolicyOverride(
            should_retry=policy.should_retry,
            should_grade=policy.should_grade,
            has_valid_reward=policy.has_valid_reward,
        )
    return overrides
