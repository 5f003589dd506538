"""Failure classes from result.json files shaped exactly as Harbor writes them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from harbor.models.agent.context import AgentContext
from harbor.models.trial.config import TaskConfig, TrialConfig
from harbor.models.trial.error_policy import ERROR_POLICIES, ErrorPolicy, policy_for
from harbor.models.trial.result import AgentInfo, ExceptionInfo, TimingInfo, TrialResult
from harbor.models.verifier.result import VerifierResult
from harbor.trial.errors import (
    AgentTimeoutError,
    EnvironmentStartTimeoutError,
    VerifierTimeoutError,
)
from harbor.verifier.verifier import RewardFileNotFoundError

from harbor_hpc.containers.errors import (
    HARBOR_EQUIVALENT,
    ContainerStartFailed,
    EnvironmentHostUnavailable,
    ImageUnavailable,
    MemoryLimitExceededError,
    SetupScriptFailed,
    UnsupportedTask,
    error_policy_overrides,
)
from harbor_hpc.results.calls import Call, CallEnd, ModelCalls
from harbor_hpc.results.classify import (
    FailureClass,
    failure_class,
    outcome_of_result,
    primary_reward,
)


def harbor_result(
    tmp_path: Path,
    *,
    rewards: dict[str, float] | None = None,
    exception: BaseException | None = None,
    agent_result: AgentContext | None = None,
    agent_started: bool = True,
    overrides: bool = True,
) -> dict[str, Any]:
    """A result.json as Harbor's TrialResult serialises it, parsed back; `agent_started`
    False for a trial whose environment never came up (no agent timings); `overrides` False
    for a trial run without our names given to Harbor's error policy (`harbor run`)."""
    config = TrialConfig(task=TaskConfig(path=tmp_path / "task"), trials_dir=tmp_path)
    result = TrialResult(
        task_name="task",
        trial_name=config.trial_name,
        trial_uri=tmp_path.as_uri(),
        task_id=config.task.get_task_id(),
        task_checksum="0",
        config=config,
        agent_info=AgentInfo(name="oracle", version="1"),
        agent_result=agent_result,
        verifier_result=VerifierResult(rewards=rewards) if rewards is not None else None,
        exception_info=ExceptionInfo.from_exception(
            exception, override_error_policy=error_policy_overrides() if overrides else None
        )
        if exception
        else None,
        agent_setup=TimingInfo() if agent_started else None,
    )
    data: dict[str, Any] = json.loads(result.model_dump_json())
    return data


@pytest.mark.parametrize(
    ("exception", "failure"),
    [
        (MemoryLimitExceededError("limit 256 MB, peak 300 MB"), "memory"),
        (SetupScriptFailed("setup.sh exited 3"), "setup"),
        (ImageUnavailable("/x.sif not found"), "image"),
        (AgentTimeoutError("Agent execution timed out after 5.0 seconds"), "timeout"),
        (VerifierTimeoutError("Verifier timed out"), "verifier"),
        (EnvironmentStartTimeoutError("start timed out"), "environment"),
        (ContainerStartFailed("apptainer: no user namespaces"), "environment"),
        (UnsupportedTask("compose services"), "unsupported"),
        (RewardFileNotFoundError("no reward"), "verifier"),
        (asyncio.CancelledError(), "infrastructure"),
        (EnvironmentHostUnavailable("task t: its Ray node 10.0.0.7 was lost"), "infrastructure"),
        (RuntimeError("agent crashed"), "agent"),
    ],
)
def test_exception_types_map_to_failure_classes(
    tmp_path: Path, exception: BaseException, failure: str
) -> None:
    outcome = outcome_of_result(harbor_result(tmp_path, exception=exception))
    assert outcome.state == "failed"
    assert outcome.failure == failure
    assert outcome.message is not None
    assert outcome.message.startswith(type(exception).__name__)


def test_anything_raised_before_the_agent_started_is_the_environments(tmp_path: Path) -> None:
    never_started = harbor_result(
        tmp_path, exception=ValueError("network_mode not supported"), agent_started=False
    )
    assert outcome_of_result(never_started).failure == "environment"
    # Known classes stay what they are, whenever they happen.
    image = harbor_result(tmp_path, exception=ImageUnavailable("gone"), agent_started=False)
    assert outcome_of_result(image).failure == "image"


def test_a_clean_trial_is_done_with_its_reward(tmp_path: Path) -> None:
    outcome = outcome_of_result(harbor_result(tmp_path, rewards={"reward": 1}))
    assert (outcome.state, outcome.failure, outcome.reward) == ("done", None, 1.0)
    unsolved = outcome_of_result(harbor_result(tmp_path, rewards={"reward": 0}))
    assert (unsolved.state, unsolved.reward) == ("done", 0.0)


def test_the_reward_survives_a_later_failure(tmp_path: Path) -> None:
    result = harbor_result(tmp_path, rewards={"reward": 1}, exception=RuntimeError("teardown"))
    outcome = outcome_of_result(result)
    assert (outcome.state, outcome.failure, outcome.reward) == ("failed", "agent", 1.0)


def test_long_messages_are_cut(tmp_path: Path) -> None:
    outcome = outcome_of_result(harbor_result(tmp_path, exception=RuntimeError("x " * 1000)))
    assert outcome.message is not None and len(outcome.message) < 400


def test_primary_reward() -> None:
    # The one rule (docs/results.md): the run's key, else `reward`, else a lone value.
    assert primary_reward({}) is None
    assert primary_reward({"accuracy": 0.5}) == 0.5
    assert primary_reward({"reward": 1, "accuracy": 0.5}) == 1.0
    assert primary_reward({"a": 1, "b": 0}) is None  # never their mean
    assert primary_reward({"correct": 1, "style": 0.5}, "style") == 0.5
    assert primary_reward({"reward": 1, "style": 0.5}, "style") == 0.5
    # A named key is the only one read: a lone value of another name is not it.
    assert primary_reward({"accuracy": 0.5}, "correct") is None


def test_several_rewards_none_named_reward_are_not_trainable(tmp_path: Path) -> None:
    # The user's reward.json: {"correct": 1, "style": 0.5}, no `reward` key.
    result = harbor_result(tmp_path, rewards={"correct": 1, "style": 0.5})
    outcome = outcome_of_result(result)
    assert (outcome.state, outcome.failure, outcome.reward) == ("failed", "verifier", None)
    assert not outcome.trainable
    assert outcome.rewards == {"correct": 1.0, "style": 0.5}  # kept, for the export line
    assert outcome.message is not None
    assert "correct, style" in outcome.message and "--reward-key" in outcome.message
    # With the run's key named, that key's value, trainable.
    named = outcome_of_result(result, reward_key="correct")
    assert (named.state, named.failure, named.reward, named.trainable) == ("done", None, 1.0, True)
    assert outcome_of_result(result, reward_key="style").reward == 0.5


def test_a_named_key_the_verifier_did_not_write(tmp_path: Path) -> None:
    outcome = outcome_of_result(harbor_result(tmp_path, rewards={"reward": 1}), reward_key="x")
    assert (outcome.failure, outcome.reward, outcome.trainable) == ("verifier", None, False)
    assert outcome.message is not None and "'x'" in outcome.message and "reward" in outcome.message


def test_the_keys_problem_is_named_when_the_agent_also_failed(tmp_path: Path) -> None:
    # The agent's own failure leaves the reward valid: what stands in the way is the keys.
    result = harbor_result(
        tmp_path, rewards={"a": 1, "b": 0}, exception=AgentTimeoutError("timed out")
    )
    outcome = outcome_of_result(result)
    assert (outcome.failure, outcome.trainable) == ("verifier", False)
    assert outcome.message is not None and "a, b" in outcome.message
    assert "AgentTimeoutError" in outcome.message
    # A failure whose reward is invalid anyway stands as it is.
    invalid = outcome_of_result(
        harbor_result(tmp_path, rewards={"a": 1, "b": 0}, exception=SetupScriptFailed("x"))
    )
    assert invalid.failure == "setup"


def test_the_reward_key_reaches_each_step(tmp_path: Path) -> None:
    from harbor_hpc.results.rollout import _step_record

    step = {"step_name": "one", **harbor_result(tmp_path, rewards={"c": 1, "s": 0})}
    assert _step_record(tmp_path, tmp_path, step, None)["failure"] == "verifier"
    assert _step_record(tmp_path, tmp_path, step, "s")["reward"] == 0.0


def named(name: str) -> BaseException:
    """An exception of type name `name`: Harbor's policy table keys on nothing else."""
    error: BaseException = type(name, (Exception,), {})(f"a {name}")
    return error


# Every group of Harbor's own table, name by name, as the policy it gives.
HARBOR_TABLE = sorted(ERROR_POLICIES.items())


@pytest.mark.parametrize(("name", "policy"), HARBOR_TABLE, ids=[n for n, _ in HARBOR_TABLE])
def test_every_name_in_harbors_error_policy_is_trainable_only_with_a_valid_reward(
    tmp_path: Path, name: str, policy: ErrorPolicy
) -> None:
    result = harbor_result(tmp_path, rewards={"reward": 0}, exception=named(name))
    outcome = outcome_of_result(result)
    assert outcome.state == "failed"
    assert outcome.valid is policy.has_valid_reward
    assert outcome.trainable is policy.has_valid_reward
    # A class that names what to fix: the agent's only where the reward stands, and a reward
    # that stands only for the agent's failures (its own, or its time running out).
    if outcome.failure is FailureClass.AGENT:
        assert policy.has_valid_reward
    if policy.has_valid_reward:
        assert outcome.failure in (FailureClass.AGENT, FailureClass.TIMEOUT), outcome.failure


def test_model_server_failures_are_named_and_never_trainable(tmp_path: Path) -> None:
    for name in ("NotFoundError", "APIConnectionError", "AuthenticationError", "RateLimitError"):
        outcome = outcome_of_result(harbor_result(tmp_path, exception=named(name)))
        assert (outcome.failure, outcome.trainable) == ("model", False), name


@pytest.mark.parametrize("overrides", [True, False], ids=["our-runs", "harbor-run"])
@pytest.mark.parametrize(("ours", "harbors"), sorted(HARBOR_EQUIVALENT.items()))
def test_our_failures_take_the_policy_of_harbors_equivalent(
    tmp_path: Path, ours: str, harbors: str, overrides: bool
) -> None:
    result = harbor_result(tmp_path, exception=named(ours), overrides=overrides)
    expected = policy_for(harbors)
    info = result["exception_info"]
    if overrides:  # what Harbor itself decides (retries, grading) for trials we start
        assert ErrorPolicy(**info["policy"]) == expected
    assert outcome_of_result(result).valid is expected.has_valid_reward
    assert not outcome_of_result(result).trainable


def test_the_memory_watchdogs_failure_has_harbors_own_name(tmp_path: Path) -> None:
    result = harbor_result(tmp_path, exception=MemoryLimitExceededError("limit 256 MB"))
    assert result["exception_info"]["exception_type"] == "MemoryLimitExceededError"
    assert ErrorPolicy(**result["exception_info"]["policy"]) == policy_for(
        "MemoryLimitExceededError"
    )
    # Runs recorded before the rename are classified alike.
    assert failure_class("MemoryLimitExceeded") == "memory"


def test_an_unknown_failure_before_the_agent_started_is_not_trainable(tmp_path: Path) -> None:
    result = harbor_result(tmp_path, exception=RuntimeError("docker"), agent_started=False)
    assert not outcome_of_result(result).trainable
    agents_own = harbor_result(tmp_path, rewards={"reward": 0}, exception=RuntimeError("crash"))
    assert outcome_of_result(agents_own).trainable


def test_an_agent_that_cannot_start_in_the_image_is_the_images(tmp_path: Path) -> None:
    """terminus-2's words in an image without tmux (recorded from a real trial): the image's
    failure, never a trainable line without a reward."""
    said = "Failed to start tmux session. Error: bash: line 2: tmux: command not found"
    outcome = outcome_of_result(harbor_result(tmp_path, exception=RuntimeError(said)))
    assert (outcome.failure, outcome.trainable) == ("image", False)
    assert outcome.message is not None and "tmux is not in it" in outcome.message


def recorded_calls(*ends: str, error: str = "InternalServerError: scripted fault") -> ModelCalls:
    """A trial's model-calls.json as the worker writes it, one call per end given."""
    return ModelCalls(
        [
            Call("2026-11-29T03:59:00+00:00", 1.0, CallEnd(end), error if end == "failed" else None)
            for end in ends
        ]
    )


@pytest.mark.parametrize(
    ("ends", "said"),
    [
        # A new user's trial: answered, then 500s, the time running out between two retries.
        (("answered", "failed", "failed", "failed", "failed", "failed"), "failed 5 of the"),
        # ... or in a retry's call.
        (("answered", "failed", "failed", "cut_off"), "failed 2 of the agent's 4 calls"),
        (("answered", "cut_off"), "waited 1 s on the model server"),
        (("cut_off",), "waited 1 s on the model server"),
    ],
)
def test_an_agent_whose_time_ran_out_on_the_model_server_is_never_trainable(
    tmp_path: Path, ends: tuple[str, ...], said: str
) -> None:
    timeout = AgentTimeoutError("Agent execution timed out after 23.0 seconds")
    result = harbor_result(tmp_path, rewards={"reward": 1}, exception=timeout)
    outcome = outcome_of_result(result, calls=recorded_calls(*ends))
    assert (outcome.failure, outcome.trainable, outcome.reward) == ("model", False, 1.0)
    assert outcome.message is not None and said in outcome.message, outcome.message
    # Its time ran out in the agent's own work after the last answer: the policy's.
    policys = outcome_of_result(result, calls=recorded_calls("answered", "failed", "answered"))
    assert (policys.failure, policys.trainable) == ("timeout", True)
