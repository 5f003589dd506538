"""Why a trial failed, in the few classes users act on, from what Harbor wrote in result.json.

Harbor records a failed trial's exception by type name (`exception_info.exception_type`). The
names come from our environment (`harbor_hpc.apptainer.errors`), from Harbor's trial loop
(`harbor.trial.errors`), its verifier (`harbor.verifier.verifier`) and its agents. Classes:

    image           the task's image is missing or cannot be converted (fix the image, rerun)
    environment     the container could not be provided: Apptainer refused (no user namespaces
                    or subuid ranges: `harbor-hpc doctor`), a bad environment kwarg, or anything
                    else that failed before the agent started (fix the cluster setup, rerun)
    unsupported     the task needs what the environment cannot give faithfully (a compose
                    feature; a directory rename its unpacked root refused)
    setup           the task's setup.sh or healthcheck failed (fix the task)
    memory          the memory watchdog killed the container (raise memory_mb or fix the task)
    timeout         the agent or the verifier ran out of time (raise timeouts or accept)
    verifier        tests did not produce a usable reward (fix tests/test.sh)
    model           the model server failed the agent: unreachable, an unknown model, a refused
                    key, a rate limit, a request it rejected (fix the server or the settings)
    agent           the agent itself failed (anything else raised while it ran)
    infrastructure  the job died, was cancelled, or the result is gone (resubmit)

Whether a failed trial's reward is valid (and so whether a trainer may learn from it) is not
ours to decide: it is Harbor's error policy for the exception's name (`validity`), with our
environment's names given to it (`harbor_hpc.apptainer.errors.error_policy_overrides`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harbor_hpc.apptainer.errors import (
    HARBOR_EQUIVALENT,
    ContainerDied,
    ContainerStartFailed,
    EnvironmentHostUnavailable,
    ImageUnavailable,
    MemoryLimitExceededError,
    SetupScriptFailed,
    UnsupportedTask,
)
from harbor_hpc.apptainer.limits import RENAME_REFUSED

if TYPE_CHECKING:
    from harbor.models.trial.error_policy import ErrorPolicy


class FailureClass(StrEnum):
    """The classes above; `status`, `export` and run records carry their values."""

    IMAGE = "image"
    ENVIRONMENT = "environment"
    UNSUPPORTED = "unsupported"
    SETUP = "setup"
    MEMORY = "memory"
    TIMEOUT = "timeout"
    VERIFIER = "verifier"
    MODEL = "model"
    AGENT = "agent"
    INFRASTRUCTURE = "infrastructure"


class AttemptState(StrEnum):
    """Where a task attempt stands; a trial that ended is `done` or `failed`."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


# The names Harbor's model clients raise (its own and litellm's, escaping its agents), as its
# error policy table lists them: none of them says anything about the policy being trained.
MODEL_SERVER_ERRORS = (
    "ApiError",
    "ApiRateLimitError",
    "ApiInternalServerError",
    "ApiOverloadedError",
    "ApiConnectionClosedError",
    "ApiResponseStalledError",
    "UnknownApiError",
    "NetworkConnectionError",
    "ApiConnectionError",
    "ApiUsageLimitError",
    "RateLimitError",
    "InternalServerError",
    "ServiceUnavailableError",
    "APIConnectionError",
    "APIError",
    "Timeout",
    "UnsupportedModelParametersError",
    "BadRequestError",
    "UnprocessableEntityError",
    "UnsupportedParamsError",
    "APIResponseValidationError",
    "BudgetExceededError",
    "AgentAuthenticationError",
    "ModelNotFoundError",
    "ApiProviderResourceNotFoundError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
)

_CLASS_OF_EXCEPTION: dict[str, FailureClass] = {
    # our environment's (harbor_hpc.apptainer.errors)
    ImageUnavailable.__name__: FailureClass.IMAGE,
    SetupScriptFailed.__name__: FailureClass.SETUP,
    ContainerStartFailed.__name__: FailureClass.ENVIRONMENT,
    UnsupportedTask.__name__: FailureClass.UNSUPPORTED,
    MemoryLimitExceededError.__name__: FailureClass.MEMORY,
    ContainerDied.__name__: FailureClass.INFRASTRUCTURE,
    EnvironmentHostUnavailable.__name__: FailureClass.INFRASTRUCTURE,
    # the name runs before harbor-hpc 0.1's rename recorded
    "MemoryLimitExceeded": FailureClass.MEMORY,
    # harbor.trial.errors
    "AgentTimeoutError": FailureClass.TIMEOUT,
    "AgentSetupTimeoutError": FailureClass.TIMEOUT,
    "VerifierTimeoutError": FailureClass.TIMEOUT,
    "EnvironmentStartTimeoutError": FailureClass.ENVIRONMENT,
    # Harbor's environments
    "HealthcheckError": FailureClass.SETUP,
    "SandboxBuildFailedError": FailureClass.IMAGE,
    "SandboxLikelyOutOfMemoryError": FailureClass.MEMORY,
    "ServiceOperationsUnsupportedError": FailureClass.UNSUPPORTED,
    "SSHAccessError": FailureClass.INFRASTRUCTURE,
    "GKEExecStreamClosedError": FailureClass.INFRASTRUCTURE,
    "GKEPodNotFoundError": FailureClass.INFRASTRUCTURE,
    "RuntimeRequestError": FailureClass.INFRASTRUCTURE,
    # Harbor's set-up: an extra not installed, an agent's own import, a regrade
    "MissingExtraError": FailureClass.ENVIRONMENT,
    "DspyImportError": FailureClass.ENVIRONMENT,
    "VercelScopeError": FailureClass.ENVIRONMENT,
    "RegradeError": FailureClass.ENVIRONMENT,
    # harbor.verifier.verifier
    "AddTestsDirError": FailureClass.VERIFIER,
    "VerifierOutputParseError": FailureClass.VERIFIER,
    "DownloadVerifierDirError": FailureClass.VERIFIER,
    "RewardFileNotFoundError": FailureClass.VERIFIER,
    "RewardFileEmptyError": FailureClass.VERIFIER,
    # The worker was stopped in the middle of the trial (scancel, preemption, time limit).
    "CancelledError": FailureClass.INFRASTRUCTURE,
    **dict.fromkeys(MODEL_SERVER_ERRORS, FailureClass.MODEL),
}

MESSAGE_LIMIT = 300


def failure_class(exception_type: str, *, agent_started: bool = True) -> FailureClass:
    """The failure class of an exception type name. Anything unknown is the agent's once the
    agent started, and the environment's before (a container that never came up)."""
    unknown = FailureClass.AGENT if agent_started else FailureClass.ENVIRONMENT
    return _CLASS_OF_EXCEPTION.get(exception_type, unknown)


def validity(exception_type: str, stored: dict[str, Any] | None = None) -> ErrorPolicy:
    """Harbor's error policy for an exception type name: retried, graded, reward valid.
    `stored` is the override Harbor recorded with it (`exception_info.policy_override`); runs
    made without one (`harbor run` with our environment, older runs) get ours for our names."""
    from harbor.models.trial.error_policy import ErrorPolicyOverride, policy_for

    from harbor_hpc.apptainer.errors import error_policy_overrides

    if stored:
        override: ErrorPolicyOverride | None = ErrorPolicyOverride.model_validate(stored)
    elif exception_type in HARBOR_EQUIVALENT:
        override = error_policy_overrides()[exception_type]
    else:
        override = None
    return policy_for(exception_type, override)


def short_message(exception_type: str, message: str) -> str:
    text = " ".join(message.split())
    if len(text) > MESSAGE_LIMIT:
        text = text[: MESSAGE_LIMIT - 3] + "..."
    return f"{exception_type}: {text}" if text else exception_type


@dataclass(frozen=True)
class Outcome:
    """What one finished trial came to: done (maybe with reward 0) or failed with a class.
    `valid`: its reward is one to learn from (Harbor's error policy says so for its failure;
    a trial that ended cleanly always), else no reward a trainer may use. `limits`: where its
    container was weaker than Docker's (apptainer/limits.py), as its folder says."""

    failure: FailureClass | None
    message: str | None
    reward: float | None
    rewards: dict[str, float]
    valid: bool = False
    limits: tuple[str, ...] = ()

    @property
    def state(self) -> AttemptState:
        return AttemptState.FAILED if self.failure else AttemptState.DONE


def primary_reward(rewards: dict[str, float]) -> float | None:
    """The one number to average: `reward` when present, a lone value, else the mean."""
    if not rewards:
        return None
    if "reward" in rewards:
        return float(rewards["reward"])
    values = list(rewards.values())
    return float(values[0]) if len(values) == 1 else sum(values) / len(values)


def outcome_of_result(result: dict[str, Any], limits: Sequence[str] = ()) -> Outcome:
    """Classify a parsed result.json (Harbor's TrialResult as JSON), given what the trial's
    folder says of its container's limits (apptainer/limits.py): where a command's directory
    rename was refused by its unpacked root, a reward below 1 is the environment's, no
    reward to learn from."""
    outcome = replace(_outcome_of_result(result), limits=tuple(limits))
    learnable = outcome.failure in (None, FailureClass.AGENT, FailureClass.TIMEOUT)
    if RENAME_REFUSED in limits and learnable and not (outcome.reward or 0) >= 1:
        return replace(
            outcome, failure=FailureClass.UNSUPPORTED, message=RENAME_REFUSED, valid=False
        )
    return outcome


def _outcome_of_result(result: dict[str, Any]) -> Outcome:
    verifier = result.get("verifier_result") or {}
    raw_rewards = verifier.get("rewards") or {}
    rewards = {
        str(key): float(value)
        for key, value in raw_rewards.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    reward = primary_reward(rewards)
    info = result.get("exception_info")
    if info:
        exception_type = str(info.get("exception_type") or "Exception")
        message = short_message(exception_type, str(info.get("exception_message") or ""))
        agent_started = bool(result.get("agent_setup") or result.get("agent_execution"))
        failure = failure_class(exception_type, agent_started=agent_started)
        policy = validity(exception_type, info.get("policy_override"))
        return Outcome(failure, message, reward, rewards, policy.has_valid_reward)
    return Outcome(None, None, reward, rewards, True)
