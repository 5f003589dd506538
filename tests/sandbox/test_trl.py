"""TRL 1.16's own HarborEnv (trl.experimental.harbor) on our sandboxes (harbor_hpc.trl): reset,
its bash tool, get_reward as GRPOTrainer and AsyncGRPOTrainer's worker call them, pickling."""

from __future__ import annotations

import functools
import inspect
import json
import math
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.sample_tasks import make_task

pytestmark = [pytest.mark.apptainer, pytest.mark.harbor, pytest.mark.trl]


def _tools(env_class: type) -> list[str]:
    """The methods GRPOTrainer gives the model as tools (its own rule, trl 1.16)."""
    return [
        name
        for name, _ in inspect.getmembers(env_class, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def test_trls_harbor_env_trains_on_our_sandboxes(debian_sif: Path, tmp_path: Path) -> None:
    from trl.experimental.harbor import HarborBashEnv as TrlBash

    from harbor_hpc.trl import HarborBashEnv

    tasks = tmp_path / "tasks"
    task = make_task(tasks, "answer", image=str(debian_sif))
    silent = make_task(tasks, "silent", image=str(debian_sif))
    (silent / "tests" / "test.sh").write_text("#!/bin/bash\necho no reward written\n")
    record = tmp_path / "rewards.jsonl"
    factory = functools.partial(HarborBashEnv, ahead=1, record=str(record))
    assert _tools(HarborBashEnv) == _tools(TrlBash) == ["bash"]
    env = pickle.loads(pickle.dumps(factory))()  # as AsyncGRPOTrainer's worker gets it

    prompt = env.reset(task_dir=str(task), prompt=[], task_index=0)
    assert prompt.startswith("Write 42 into /tmp/answer.") and "/workdir/answer.txt" in prompt
    assert env.bash("test -d /workdir && echo 42 > /tmp/answer && id -u").strip() == "0"
    assert env.get_reward() == 1.0 and env.reward == 1.0

    env.reset(task_dir=str(task))
    env.bash("echo 41 > /tmp/answer")
    assert env.get_reward() == 0.0

    env.reset(task_dir=str(silent))
    env.bash("true")
    assert env.get_reward() is None and math.isnan(env.reward)  # TRL leaves it out
    assert env.outcome is not None and env.outcome.failure == "verifier"

    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(line["reward"], line["trainable"]) for line in lines] == [
        (1.0, True),
        (0.0, True),
        (None, False),
    ]
    assert "RewardFile" in lines[2]["message"]


def test_a_batch_of_resets_then_tools_from_a_thread_pool(debian_sif: Path, tmp_path: Path) -> None:
    """GRPOTrainer resets a batch's environments one after another, then calls their tools;
    AsyncGRPOTrainer's worker calls reset, the tools and get_reward from a thread pool."""
    from harbor_hpc.trl import HarborBashEnv

    tasks = [make_task(tmp_path / "tasks", f"t{i}", image=str(debian_sif)) for i in range(3)]
    envs = [HarborBashEnv() for _ in range(6)]
    for env, task in zip(envs, tasks * 2, strict=True):
        env.reset(task_dir=str(task))  # returns at once: the sandboxes start side by side

    def rollout(pair: tuple[HarborBashEnv, int]) -> float | None:
        env, i = pair
        env.bash(f"echo {42 if i % 2 == 0 else 7} > /tmp/answer")
        return env.get_reward()

    with ThreadPoolExecutor(6) as pool:
        rewards = list(pool.map(rollout, [(env, i) for i, env in enumerate(envs)]))
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_a_setting_trl_does_not_know_is_refused_at_once() -> None:
    from harbor_hpc.core.errors import InputError
    from harbor_hpc.trl import HarborBashEnv

    with pytest.raises(InputError, match="environment_type='e2b'"):
        HarborBashEnv(environment_type="e2b")
    with pytest.raises(InputError, match="no_such_option"):
        HarborBashEnv(environment_kwargs={"no_such_option": 1})


_TRAINER = """
import sys
from harbor_hpc.trl import HarborBashEnv
envs = [HarborBashEnv(ahead=1) for _ in range(2)]
for env in envs:
    env.reset(task_dir=sys.argv[1])
envs[0].bash(f"sleep {sys.argv[2]} >/dev/null 2>&1 &")
if sys.argv[3] == "crash":
    raise RuntimeError("the trainer crashed")
"""


@pytest.mark.parametrize("how", ["ends", "crash"])
def test_a_trainer_that_ends_with_sandboxes_open_exits_and_leaves_nothing(
    how: str, debian_sif: Path, tmp_path: Path
) -> None:
    """Its sandboxes (two it holds, one started ahead) stop at its exit, and it exits."""
    import os
    import subprocess
    import sys

    from tests.support.processes import gone_within, left_naming

    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    sleep = f"{900 + os.getpid() % 97}.{len(how)}"
    ended = subprocess.run(
        [sys.executable, "-c", _TRAINER, str(task), sleep, how],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert ended.returncode == (1 if how == "crash" else 0), ended.stderr
    assert gone_within(30, lambda: left_naming(f"sleep {sleep}")) == []
