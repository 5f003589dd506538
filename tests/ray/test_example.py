"""examples/ray_rollouts.py as a trainer runs it, as the ordinary test user: one process, two
rollouts of terminus-2 through Harbor's `Trial` at once against the scripted model server, their
containers on the two nodes of a Ray cluster `harbor-hpc ray up` started on Slurm."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_terminus2 import turn
from tests.ray.conftest import RayCluster
from tests.support.cli import cli_json
from tests.support.sample_tasks import make_task
from tests.support.scripted_llm import Exchange, ScriptedLLM

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.ray,
    pytest.mark.apptainer,
    pytest.mark.docker,
    pytest.mark.harbor,
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_rollouts.py"
# The rollouts share one server, so any of them may get any reply: each reply writes the answer
# and says the task is done, and terminus-2's confirmation turn gets the same. Two calls each.
REPLY = turn(["echo 42 > /tmp/answer\n"], done=True)
LINE = re.compile(
    r"answer #(?P<attempt>\d): trial=(?P<trial>\S+) node=(?P<node>\S+) node_id=(?P<node_id>\S+) "
    r"reward=(?P<reward>\S+) "
    r"trainable=(?P<trainable>\S+) policy_tokens=(?P<policy>\d+)/(?P<total>\d+)"
)


def recorded(trial: Path) -> list[tuple[list[int], list[int], list[float]]]:
    """The tokens Harbor recorded for the trial: per model call, prompt, completion, logprobs."""
    result = json.loads((trial / "result.json").read_text())
    (details,) = result["agent_result"]["rollout_details"]
    return list(
        zip(
            details["prompt_token_ids"],
            details["completion_token_ids"],
            details["logprobs"],
            strict=True,
        )
    )


def test_two_rollouts_of_one_trainer_process_run_on_two_ray_nodes(
    ray_cluster: RayCluster, debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    trials = tmp_path / "trials"
    env = {
        **os.environ,
        "OPENAI_API_KEY": "scripted-test-key",  # litellm wants one; unchecked
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch from the internet
    }
    status = cli_json("ray", "status", "--cluster-dir", str(ray_cluster["cluster_dir"]))
    nodes = {node["node_id"] for node in status["ray_nodes"]}
    assert len(nodes) == 2, nodes
    # As a uv user runs it: below `uv run`, Ray would start the hosts through `uv run` as well,
    # in a new virtualenv without Ray, and no environment would ever start.
    uv = shutil.which("uv")
    assert uv is not None, "uv is not on PATH"
    with ScriptedLLM([REPLY]) as llm, (tmp_path / "stderr").open("w+") as stderr:
        example = subprocess.run(
            [uv, "run", "--frozen", "--no-sync", "python",
             str(EXAMPLE), str(task), str(trials), "--api-base", llm.url,
             "--model", f"openai/{llm.model}", "--rollouts", "2",
             # A Ray node has one CPU: a rollout each.
             "--ray-cpus", "1", "--ray-cluster-dir", str(ray_cluster["cluster_dir"])],
            env=env, cwd=EXAMPLE.parents[1], stdout=subprocess.PIPE, stderr=stderr, text=True,
            timeout=600, check=False,
        )  # fmt: skip
        stderr.seek(0)
        assert example.returncode == 0, stderr.read()[-3000:]
        out = example.stdout
        sent: list[Exchange] = llm.exchanges
    assert stat.S_IMODE(trials.stat().st_mode) == 0o700  # what the agent saw is the user's alone
    found = [LINE.fullmatch(line) for line in out.splitlines()]
    assert all(found) and len(found) == 2, out
    lines = [match.groupdict() for match in found if match]
    assert [line["attempt"] for line in lines] == ["0", "1"]
    assert {line["node"] for line in lines} == {ray_cluster["address"].rpartition(":")[0]}
    # One container on each of the two Ray nodes (a CPU each), none in the trainer's process.
    assert {line["node_id"] for line in lines} == nodes
    assert [(line["reward"], line["trainable"]) for line in lines] == [("1.0", "True")] * 2

    # Each trial's tokens are the server's, every call of both accounted for once; the policy's
    # tokens (mask 1) are its completions, the sequence its last prompt and completion.
    assert len(sent) == 4 and [e.reply for e in sent] == llm.replies * 4
    calls = [call for line in lines for call in recorded(trials / line["trial"])]
    assert sorted(calls) == sorted(
        (e.prompt_token_ids, e.completion_token_ids, e.logprobs) for e in sent
    )
    for line in lines:
        (_, first, _), (last_prompt, last, _) = recorded(trials / line["trial"])
        assert int(line["policy"]) == len(first) + len(last)
        assert int(line["total"]) == len(last_prompt) + len(last)


def test_a_rollout_that_failed_says_why_and_the_example_exits_1(tmp_path: Path) -> None:
    # No Ray cluster to run on: each environment fails to start, an infrastructure failure.
    task = make_task(tmp_path / "tasks", "answer", image=str(tmp_path / "unused.sif"))
    env = {**os.environ, "OPENAI_API_KEY": "unused", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.pop("RAY_ADDRESS", None)
    example = subprocess.run(
        [sys.executable, str(EXAMPLE), str(task), str(tmp_path / "trials"),
         "--api-base", "http://127.0.0.1:9/v1", "--model", "openai/policy",
         "--ray-cluster-dir", str(tmp_path / "no-cluster")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert example.returncode == 1, example.stderr[-3000:]
    (line,) = example.stdout.splitlines()
    assert "reward=None trainable=False" in line
    assert "failed=infrastructure: " in line and "no Ray cluster to run environments on" in line
