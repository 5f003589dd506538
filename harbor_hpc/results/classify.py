"""Why a trial failed, in the few classes users act on, from what Harbor wrote in result.json.

Harbor records a failed trial's exception by type name (`exception_info.exception_type`). The
names come from our environment (`harbor_hpc.containers.errors`), from Harbor's trial loop
(`harbor.trial.errors`), its verifier (`harbor.verifier.verifier`) and its agents. Classes:

    image           the task's image is missing or cannot be converted (fix the image, rerun)
    environment     the container could not be provided: Apptainer refused (no user namespaces
                    or subuid ranges: `harbor-hpc doctor`), a bad environment kwarg, or anything
                    else that failed before the agent started (fix the cluster setup, rerun)
    unsupported     the task needs what the environment cannot give faithfully (a compose
                    feature)
    setup           the task's setup.sh or healthcheck failed (fix the task)
    memory          the memory watchdog killed the container (raise memory_mb or fix the task)
    timeout         the agent ran out of time (raise its timeout or accept: the policy's)
    verifier        tests did not produce a usable reward (fix tests/test.sh), wrote several
                    rewards and none the run reads (name it: `--reward-key`), or ran out of
                    their time (raise [verifier] timeout_sec in task.toml)
    model           the model server failed the agent: unreachable, an unknown model, a refused
                    key, a rate limit, a request it rejected (fix the server or the settings)
    agent           the agent itself failed (anything else raised while it ran)
    infrastructure  the job died, was cancelled, or the result is gone (resubmit)

Whether a failed trial's reward is valid (and so whether a trainer may learn from it) is not
ours to decide: it is Harbor's error policy for the exception's name (`validity`), with our
environment's names given to it (`harbor_hpc.containers.errors.error_policy_overrides`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_hpc.containers.errors import (
    HARBOR_EQUIVALENT,
    ContainerDied,
    ContainerStartFailed,
    EnvironmentHostUnavailable,
    ImageUnavailable,
    MemoryLimitExceededError,
    SetupScriptFailed,
    UnsupportedTask,
)
from harbor_hpc.containers.limits import DISK_FULL_PREFIX, read_limits
from harbor_hpc.results.calls import CallEnd, ModelCalls, read_calls

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
    # our environment's (harbor_hpc.containers.errors)
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
    # The verifier's time is the task's, never the policy's (Harbor: no valid reward).
    "VerifierTimeoutError": FailureClass.VERIFIER,
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

    from harbor_hpc.containers.errors import error_policy_overrides

    if stored:
        override: ErrorPolicyOverride | None = ErrorPolicyOverride.model_validate(stored)
    elif exception_type in HARBOR_EQUIVALENT:
        override = error_policy_overrides()[exception_type]
    else:
        override = None
    return policy_for(exception_type, override)


# What a user reads for a failure whose own message does not say what to do: appended to it.
_WHAT_TO_DO = {
    "VerifierTimeoutError": (
        "the task's tests/test.sh ran past its verifier timeout; raise [verifier] timeout_sec "
        "in the task's task.toml, or make tests/test.sh faster (no reward, not trainable)"
    ),
}


def short_message(exception_type: str, message: str) -> str:
    text = " ".join(message.split())
    if len(text) > MESSAGE_LIMIT:
        text = text[: MESSAGE_LIMIT - 3] + "..."
    if todo := _WHAT_TO_DO.get(exception_type):
        text = f"{text.rstrip('.')}: {todo}" if text else todo
    return f"{exception_type}: {text}" if text else exception_type


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one finished trial came to: done (maybe with reward 0) or failed with a class.
    `valid`: its reward is one to learn from (Harbor's error policy says so for its failure;
    a trial that ended cleanly always), else no reward a trainer may use. `limits`: where its
    container was weaker than Docker's (containers/limits.py), as its folder says."""

    failure: FailureClass | None
    message: str | None
    reward: float | None
    rewards: dict[str, float]
    valid: bool = False
    limits: tuple[str, ...] = ()

    @property
    def state(self) -> AttemptState:
        return AttemptState.FAILED if self.failure else AttemptState.DONE

    @property
    def trainable(self) -> bool:
        """Whether the policy alone made this outcome, so that a trainer may learn from its
        reward: Harbor's error policy calls the reward valid (the trial ended, or the agent
        failed it: its own error, its time or its context ran out), the evidence found nothing
        else to blame (`outcome_of_result`), and the agent ran (a failure Harbor does not know,
        raised before the agent started, is the environment's, whatever Harbor's default)."""
        return self.valid and self.failure in (None, FailureClass.AGENT, FailureClass.TIMEOUT)


# The key a verifier's reward.json names its one reward by when the run names none.
REWARD_KEY = "reward"
# How many of a reward.json's keys a message names.
_KEYS_SHOWN = 8


def primary_reward(rewards: dict[str, float], reward_key: str | None = None) -> float | None:
    """The one reward a trainer learns from (docs/results.md, "Which reward"): the value of
    `reward_key` when the run names one; else the value named `reward`; else a lone value; else
    none (several values, none of them `reward`: `reward_problem` says why)."""
    key = reward_key or REWARD_KEY
    if key in rewards:
        return float(rewards[key])
    if reward_key is None and len(rewards) == 1:
        return float(next(iter(rewards.values())))
    return None


def reward_problem(rewards: dict[str, float], reward_key: str | None = None) -> str | None:
    """Why the verifier's `rewards` give no primary reward (`primary_reward`), naming the keys
    it wrote and what to do; None when they give one, or are empty (no reward at all)."""
    if not rewards or primary_reward(rewards, reward_key) is not None:
        return None
    keys = sorted(rewards)
    found = ", ".join(keys[:_KEYS_SHOWN]) + (
        f" and {len(keys) - _KEYS_SHOWN} more" if len(keys) > _KEYS_SHOWN else ""
    )
    if reward_key is not None:
        return (
            f"no reward named {reward_key!r} (the run's reward key): the verifier wrote "
            f"{found}; fix the task's tests, or submit to a new run folder with another "
            "--reward-key"
        )
    return (
        f"no primary reward: the verifier wrote {len(keys)} rewards ({found}) and none named "
        f"{REWARD_KEY!r}; name the one to train on (--reward-key {keys[0]}, reward_key= in "
        f"Python) or have the task's tests write a {REWARD_KEY!r} key"
    )


def outcome_of_result(
    result: dict[str, Any],
    limits: Sequence[str] = (),
    calls: ModelCalls | None = None,
    *,
    reward_key: str | None = None,
) -> Outcome:
    """Classify a parsed result.json (Harbor's TrialResult as JSON), given what the trial's
    folder says of its container's limits (containers/limits.py) and of its model calls
    (results/calls.py): the validity rule of docs/results.md. An outcome Harbor leaves to the
    policy (the trial ended, the agent failed it, or its time ran out) is the policy's only
    where the evidence says so; else it names what failed:

    - the agent's time ran out while a model call waited on the server, or no call was ever
      answered: the model server's (`model`);
    - an answer lacked the token ids or log-probs its call asked for: the model server's;
    - the agent could not start in the image (a tool it runs, `tmux: command not found`):
      the image's (`image`);
    - a write refused while its scratch disk was full, and the trial failed or scored below 1:
      `infrastructure`, whatever failed then (the agent's write, the verifier's upload);
    - no reward at all: none to learn from (its failure stands);
    - rewards but no primary one (`primary_reward` with the run's `reward_key`): `verifier`,
      naming the keys the verifier wrote.
    """
    outcome = replace(_outcome_of_result(result, reward_key), limits=tuple(limits))
    full = next((limit for limit in limits if limit.startswith(DISK_FULL_PREFIX)), None)
    if full is not None and (outcome.failure is not None or not (outcome.reward or 0) >= 1):
        # Whatever then failed (the agent's write, the verifier's upload) failed for the node.
        return replace(outcome, failure=FailureClass.INFRASTRUCTURE, message=full, valid=False)
    if outcome.failure not in (None, FailureClass.AGENT, FailureClass.TIMEOUT):
        return outcome
    why = _not_the_policys(outcome, limits, calls)
    if why is not None:
        failure, message = why
        return replace(outcome, failure=failure, message=message, valid=False)
    if outcome.reward is None:
        return replace(outcome, valid=False)
    return outcome


def outcome_of_trial(trial_dir: Path, result: dict[str, Any], *, reward_key: str | None) -> Outcome:
    """`outcome_of_result` with what `trial_dir` says of the trial's limits and model calls,
    its reward read by the run's `reward_key` (None: the default rule)."""
    return outcome_of_result(
        result, read_limits(trial_dir), read_calls(trial_dir), reward_key=reward_key
    )


# What a shell says of a program the image lacks (bash: `tmux: command not found`, dash:
# `tmux: not found`), in the words an agent that could not start passes on.
_NOT_FOUND = re.compile(r"([A-Za-z0-9_.+-]+): (?:command )?not found")


def _not_the_policys(
    outcome: Outcome, limits: Sequence[str], calls: ModelCalls | None
) -> tuple[FailureClass, str] | None:
    """What made `outcome` other than the policy, by the rule above; None when it was the
    policy's."""
    timed_out = outcome.failure is FailureClass.TIMEOUT
    answered = len(calls.answered) if calls is not None else None
    if (
        calls is not None
        and calls.calls
        and timed_out
        and calls.calls[-1].end is not CallEnd.ANSWERED
    ):
        # The agent's time ran out on the model server: waiting on a call, or between the
        # retries of calls the server failed.
        last, before = calls.calls[-1], calls.calls[-2] if len(calls.calls) > 1 else None
        if last.end is CallEnd.CUT_OFF and (before is None or before.end is CallEnd.ANSWERED):
            return FailureClass.MODEL, (
                f"the agent's time ran out while it waited {last.seconds:.0f} s on the model "
                f"server for an answer (call {len(calls.calls)}; {answered} answered before): "
                "the server hung or was too slow, not the policy"
            )
        failed = [call for call in calls.calls if call.end is CallEnd.FAILED]
        return FailureClass.MODEL, (
            f"the model server failed {len(failed)} of the agent's {len(calls.calls)} calls "
            f"({answered} answered; the last said {calls.last_error}), and the agent's time ran "
            "out retrying: the server's, not the policy's"
        )
    if calls is not None and calls.calls and not answered:
        said = f"; the last said {calls.last_error}" if calls.last_error else ""
        return FailureClass.MODEL, (
            f"the model server answered none of the agent's {len(calls.calls)} call(s){said}"
        )
    if calls is not None and (lacking := calls.without_tokens):
        return FailureClass.MODEL, (
            f"the model server sent no token ids or log-probs in {len(lacking)} of its "
            f"{answered} answers, though each call asked for them (a server restarted without "
            "them?): no tokens to train on"
        )
    if outcome.failure is FailureClass.AGENT and not answered:
        missing = _NOT_FOUND.search(outcome.message or "")
        if missing:
            return FailureClass.IMAGE, (
                f"the agent could not start in the image: {missing.group(1)} is not in it "
                f"({outcome.message}); add it to the image's Dockerfile and build again"
            )
    return None


def rewards_of(result: dict[str, Any]) -> dict[str, float]:
    """The verifier's rewards in a parsed result.json (numbers only)."""
    raw = (result.get("verifier_result") or {}).get("rewards") or {}
    return {
        str(key): float(value)
        for key, value in raw.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def _outcome_of_result(result: dict[str, Any], reward_key: str | None) -> Outcome:
    rewards = rewards_of(result)
    reward = primary_reward(rewards, reward_key)
    problem = reward_problem(rewards, reward_key)
    info = result.get("exception_info")
    if info:
        exception_type = str(info.get("exception_type") or "Exception")
        message = short_message(exception_type, str(info.get("exception_message") or ""))
        agent_started = bool(result.get("agent_setup") or result.get("agent_execution"))
        failure = failure_class(exception_type, agent_started=agent_started)
        policy = validity(exception_type, info.get("policy_override"))
        if problem is not None and policy.has_valid_reward:
            # The reward would have stood but for the verifier's keys: that is what to fix.
            return Outcome(FailureClass.VERIFIER, f"{problem} (the trial also ended {message})",
                           None, rewards, False)  # fmt: skip
        return Outcome(failure, message, reward, rewards, policy.has_valid_reward)
    if problem is not None:
        return Outcome(FailureClass.VERIFIER, problem, None, rewards, False)
    return Outcome(None, None, reward, rewards, True)
