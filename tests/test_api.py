"""The Python API: one surface, and the same harbor-hpc.toml the CLI reads."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest

import harbor_hpc.api
from harbor_hpc.api import (
    ExportFormat,
    InputError,
    RolloutRequest,
    load_config,
    run_rollouts,
)
from harbor_hpc.steps.rollouts import Backend, in_python_words
from harbor_hpc.steps.submit.options import configured_options
from harbor_hpc.steps.submit.waves import exported
from tests.support.sample_tasks import make_task
from tests.support.scripted_llm import ScriptedLLM


def test_every_name_of_the_surface_is_there() -> None:
    missing = [name for name in harbor_hpc.api.__all__ if not hasattr(harbor_hpc.api, name)]
    assert missing == []
    # The environments are the very classes Harbor loads by import path.
    from harbor_hpc.environment import RaySingularityEnvironment, SingularityEnvironment

    assert harbor_hpc.api.SingularityEnvironment is SingularityEnvironment
    assert harbor_hpc.api.RaySingularityEnvironment is RaySingularityEnvironment


def test_options_not_given_come_from_the_config_and_given_ones_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "harbor-hpc.toml").write_text(
        'partition = "cpu"\nconcurrency = 4\nscratch_dir = "/local/scratch"\nqos = "low"\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    options = configured_options(load_config(), agent="oracle", qos="high", concurrency=None)
    assert options.placement.partition == "cpu"
    assert options.concurrency == 4
    assert options.scratch_dir == Path("/local/scratch")
    assert options.placement.qos == "high"
    assert options.executor == "auto" and options.tasks_per_job == 1  # nothing said: defaults


def test_a_step_request_takes_the_config_as_the_cli_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`configured` is the one merge of harbor-hpc.toml with what a caller gave, for the CLI's
    flags and the Python API alike."""
    (tmp_path / "harbor-hpc.toml").write_text(
        'manifest = "~/m.json"\njobs = 5\ncache_dir = "/from/config"\npartition = "cpu"\n'
        'build_args = ["A=1", "B=2"]\ntime_min = 30\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    monkeypatch.setenv("HARBOR_HPC_CACHE", "/from/env")
    convert = harbor_hpc.api.configured(harbor_hpc.api.ConvertRequest, jobs=None)
    assert convert.manifest == Path("~/m.json").expanduser() and convert.jobs == 5
    assert convert.cache_dir == Path("/from/env")  # $HARBOR_HPC_CACHE before the file
    build = harbor_hpc.api.configured(
        harbor_hpc.api.BuildRequest, tasks_dir=tmp_path, build_args=["B=3"], jobs=1
    )
    assert build.build_args == ["A=1", "B=2", "B=3"] and build.jobs == 1  # given wins
    placement = harbor_hpc.api.configured(harbor_hpc.api.SlurmPlacement, qos="high")
    # A build's or conversion's time is never the file's time_min, which sizes trials.
    assert (placement.partition, placement.qos, placement.time_min) == ("cpu", "high", None)
    assert configured_options(None, agent="oracle").placement.time_min == 30


def test_a_required_field_neither_given_nor_configured_names_its_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HARBOR_HPC_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    with pytest.raises(harbor_hpc.api.InputError, match="no manifest given") as raised:
        harbor_hpc.api.configured(harbor_hpc.api.ConvertRequest)
    assert raised.value.hint == "pass --manifest, or set manifest in harbor-hpc.toml"


def request(tmp_path: Path, **given: Any) -> RolloutRequest:
    given = {"agent": "oracle", "tasks": tmp_path / "tasks", "run_dir": tmp_path / "run", **given}
    return RolloutRequest(**given)


def test_enum_arguments_take_their_string_values_or_are_refused(tmp_path: Path) -> None:
    """As a JSON config or a CLI wrapper passes them; never a silent fallback."""
    assert request(tmp_path, format="harbor-rl").format is ExportFormat.HARBOR_RL
    assert request(tmp_path, format=ExportFormat.NEMO_GYM).format is ExportFormat.NEMO_GYM
    assert request(tmp_path, executor="ray").executor is Backend.RAY
    with pytest.raises(InputError, match="format 'bogus' is not one of full, harbor-rl, nemo-gym"):
        request(tmp_path, format="bogus")
    with pytest.raises(
        InputError, match="executor 'ray-cluster' is not one of local, slurm, auto, ray"
    ):
        request(tmp_path, executor="ray-cluster")
    with pytest.raises(InputError, match="deadline_s must be a number of seconds above 0"):
        request(tmp_path, deadline_s=0)
    with pytest.raises(InputError, match=r"^format 'Full' is not one of"):
        harbor_hpc.api.rollout_lines(tmp_path / "run", [], fmt="Full")


def test_kwargs_take_paths_and_refuse_what_a_run_cannot_record(tmp_path: Path) -> None:
    """A trainer passes a Path where the CLI passes text; an object JSON cannot hold is
    named by its key when the request is made, not a TypeError when the run is written."""
    made = request(tmp_path, environment_kwargs={"ray_cluster_dir": tmp_path / "cluster"})
    assert made.environment_kwargs == {"ray_cluster_dir": str(tmp_path / "cluster")}
    with pytest.raises(InputError, match=r"agent_kwargs\['client'\] is of type object"):
        request(tmp_path, agent_kwargs={"client": object()})


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"attempts": "2"}, "attempts must be a whole number of at least 1, not '2'"),
        ({"attempts": 0}, "attempts must be a whole number of at least 1, not 0"),
        ({"concurrency": 2.5}, "concurrency must be a whole number of at least 1, not 2.5"),
        ({"environment_kwargs": "fakeroot=false"}, "environment_kwargs must be a dict"),
        ({"agent_kwargs": [("api_base", "x")]}, "agent_kwargs must be a dict"),
        ({"agent_env": ["A", 1]}, "agent_env must be a list of strings"),
        ({"model_check": "no"}, "model_check must be True or False, not 'no'"),
        ({"deadline_s": "60"}, "deadline_s must be a number of seconds above 0, not '60'"),
        ({"agent": None}, "agent must be a string, not None"),
        ({"run_dir": 3}, "run_dir must be a path, not int 3"),
        ({"reward_key": ""}, "reward_key must name a key of the verifier's reward.json, not ''"),
        ({"reward_key": 1}, "reward_key must name a key of the verifier's reward.json, not 1"),
        ({"rerun_changed": "yes"}, "rerun_changed must be True or False, not 'yes'"),
    ],
)
def test_a_wrong_type_is_refused_in_python_words_when_the_request_is_made(
    tmp_path: Path, given: dict[str, Any], said: str
) -> None:
    """Each was a raw TypeError or AttributeError deep in the batch."""
    with pytest.raises(InputError, match=re.escape(said)):
        request(tmp_path, **given)


def test_errors_raised_to_python_name_fields_and_functions_not_flags() -> None:
    said = in_python_words(
        "pick another --run-dir, or `harbor-hpc resubmit` to continue; "
        "fix --agent-kwarg api_base or --model"
    )
    assert said == (
        "pick another run_dir, or `harbor_hpc.api.resubmit_run(run_dir)` to continue; "
        "fix agent_kwargs api_base or model"
    )
    # Another command's flag, in a hint to run it, keeps its dashes; a switch is its field.
    assert in_python_words("run `harbor-hpc rewrite --sif`") == "run `harbor-hpc rewrite --sif`"
    assert in_python_words("or --no-model-check") == "or model_check=False"
    assert in_python_words("pass --rerun-changed, or another --reward-key") == (
        "pass rerun_changed, or another reward_key"
    )


def test_the_api_functions_speak_python(tmp_path: Path) -> None:
    """What the CLI shares with the API (resubmit, status, export) names functions there."""
    for call in (
        lambda: harbor_hpc.api.resubmit_run(tmp_path / "gone"),
        lambda: harbor_hpc.api.run_status(tmp_path / "gone"),
    ):
        with pytest.raises(InputError, match="no such folder") as raised:
            call()
        assert "harbor_hpc.api.run_rollouts" in (raised.value.hint or "")
        assert "harbor-hpc" not in (raised.value.hint or "")


def task_with_an_image(tmp_path: Path, name: str = "answer") -> Path:
    image = tmp_path / "images" / "answer.sif"
    image.parent.mkdir(exist_ok=True)
    image.write_bytes(b"")  # only its presence is asked, before anything runs
    return make_task(tmp_path / "tasks", name, image=str(image))


def test_a_wrong_model_is_raised_once_before_the_batch_in_python_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")
    task_with_an_image(tmp_path)
    with ScriptedLLM(["reply"]) as llm:
        wrong = request(
            tmp_path,
            agent="terminus-2",
            model="openai/policy",
            agent_kwargs={"api_base": llm.url},
            attempts=8,
        )
        with pytest.raises(InputError) as raised:
            run_rollouts(wrong)
    assert f"the model server at {llm.url} does not serve 'policy' (model openai/policy)" in str(
        raised.value
    )
    assert raised.value.hint == "model openai/scripted"
    assert not (tmp_path / "run" / "run.json").exists()  # nothing recorded, nothing queued
    assert llm.exchanges == []


def test_a_model_litellm_cannot_route_is_raised_before_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server serves the bare name, but litellm needs a provider: every trial's calls
    failed in the agent, 55 s each, though the check of the server passed."""
    monkeypatch.setenv("OPENAI_API_KEY", "scripted-test-key")
    task_with_an_image(tmp_path)
    with ScriptedLLM(["reply"]) as llm:
        bare = request(
            tmp_path, agent="terminus-2", model=llm.model, agent_kwargs={"api_base": llm.url}
        )
        with pytest.raises(InputError, match=f"model {llm.model}: litellm, the agent's model "):
            run_rollouts(bare)
    assert not (tmp_path / "run" / "run.json").exists() and llm.exchanges == []


def test_a_task_without_its_image_is_raised_before_the_batch(tmp_path: Path) -> None:
    make_task(tmp_path / "tasks", "lost", image=str(tmp_path / "gone.sif"))
    task_with_an_image(tmp_path, "fine")
    with pytest.raises(InputError, match=r"1 task\(s\) have no image to run: .*lost.*gone\.sif"):
        run_rollouts(request(tmp_path))
    assert not (tmp_path / "run" / "run.json").exists()


def test_a_list_field_given_a_string_is_refused_when_the_request_is_made(tmp_path: Path) -> None:
    """`setup="module load apptainer"` would run each character as a shell line."""
    for name in ("setup", "sbatch_args", "agent_env"):
        given: dict[str, Any] = {name: "x y"}  # as a caller without a type checker may
        with pytest.raises(InputError) as raised:
            RolloutRequest(tasks=tmp_path, run_dir=tmp_path / "run", agent="oracle", **given)
        assert str(raised.value) == f"{name} must be a list of strings, not the string 'x y'"
        assert raised.value.hint == f"{name}=['x y']"
    assert not (tmp_path / "run").exists()


def test_batches_queued_at_once_from_threads_each_hand_on_the_agents_variables() -> None:
    # A trainer runs two batches at once, a thread each, with the same --agent-env: the one
    # that ended queueing took the key away from under the other's sbatch (whose agents then
    # ran without it), unless they queue one after the other.
    name = "HARBOR_HPC_TEST_AGENT_KEY"
    first_in, first_out = threading.Event(), threading.Event()
    seen: list[str | None] = []

    def first() -> None:
        with exported({name: "k"}):
            first_in.set()
            first_out.wait(10)

    def second() -> None:
        first_in.wait(10)
        with exported({name: "k"}):
            first_out.wait(10)
            seen.append(os.environ.get(name))  # what this batch's jobs would get

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    first_in.wait(10)
    threading.Timer(0.5, first_out.set).start()  # the first batch ends its queueing
    for thread in threads:
        thread.join(15)
    assert seen == ["k"]
    assert name not in os.environ
