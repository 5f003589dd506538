"""Real trials (the oracle, local executor) of issue 55's two reports: a reward.json of several
keys, none named `reward`, and a task whose tests change between two requests on one run_dir."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from harbor_hpc.api import InputError, RolloutRequest, TaskChangedError, run_rollouts
from tests.support.cli import cli, cli_json
from tests.support.sample_tasks import make_task

pytestmark = [pytest.mark.apptainer, pytest.mark.docker]

# The user's verifier: two keys and none named `reward`.
TWO_KEYS = """#!/bin/bash
mkdir -p /logs/verifier
echo '{"correct": 1, "style": 0.5}' > /logs/verifier/reward.json
"""
QUARTER = "#!/bin/bash\nmkdir -p /logs/verifier\necho 0.25 > /logs/verifier/reward.txt\n"


def test_a_reward_json_of_two_keys_is_read_by_the_runs_key_or_not_at_all(
    debian_sif: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    task = make_task(tasks, "two-keys", image=str(debian_sif))
    (task / "tests" / "test.sh").write_text(TWO_KEYS)
    request = RolloutRequest(tasks=tasks, run_dir=tmp_path / "unnamed", agent="oracle")
    [line] = run_rollouts(request)
    assert (line["reward"], line["trainable"], line["failure"]) == (None, False, "verifier")
    assert line["rewards"] == {"correct": 1.0, "style": 0.5}  # what the verifier said, kept
    assert "correct, style" in line["message"] and "reward" in line["message"]
    # status and export read the run as the worker did.
    [status] = cli_json("status", str(request.run_dir))
    assert (status["failure"], status["trainable"], status["reward"]) == ("verifier", False, None)

    named = replace(request, run_dir=tmp_path / "named", reward_key="correct")
    [line] = run_rollouts(named)
    assert (line["reward"], line["trainable"], line["failure"]) == (1.0, True, None)
    assert json.loads((named.run_dir / "run.json").read_text())["options"]["reward_key"] == (
        "correct"
    )
    [status] = cli_json("status", str(named.run_dir))
    assert (status["reward"], status["trainable"]) == (1.0, True)
    out = tmp_path / "named.jsonl"
    cli("export", str(named.run_dir), "--out", str(out))
    [exported] = [json.loads(text) for text in out.read_text().splitlines()]
    assert (exported["reward"], exported["trainable"]) == (1.0, True)
    # Another key into the same run folder would read its trials otherwise: refused.
    with pytest.raises(InputError, match="another reward_key"):
        run_rollouts(replace(named, reward_key="style"))


def test_a_task_whose_tests_changed_is_refused_never_answered_from_its_old_trials(
    debian_sif: Path, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks"
    make_task(tasks, "kept", image=str(debian_sif))
    changed = make_task(tasks, "changed", image=str(debian_sif))
    run_dir = tmp_path / "run"
    request = RolloutRequest(tasks=tasks, run_dir=run_dir, agent="oracle", concurrency=2)
    assert {line["task"]: line["reward"] for line in run_rollouts(request)} == {
        "kept": 1.0,
        "changed": 1.0,
    }

    (changed / "tests" / "test.sh").write_text(QUARTER)
    (changed / "instruction.md").write_text("Write 42 into /tmp/answer, and quickly.\n")
    began = time.monotonic()
    with pytest.raises(TaskChangedError) as refused:
        run_rollouts(request)
    assert refused.value.exit_code == 2 and refused.value.tasks == ["changed"]
    assert "changed (instruction.md, tests)" in refused.value.message
    assert "rerun_changed" in (refused.value.hint or "")  # in Python's words
    # The CLI refuses it the same way: one line, exit 2, no traceback, nothing queued.
    submit = ["submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir)]
    for argv in ([*submit, "--executor", "local"], ["resubmit", str(run_dir)]):
        said = cli(*argv, check=False)
        assert said.returncode == 2, said.stderr
        assert "Traceback" not in said.stderr
        assert "1 task(s) changed since this run ran them: changed (instruction.md, tests)" in (
            said.stderr
        )
        assert "--rerun-changed" in said.stderr
    assert len(json.loads((run_dir / "run.json").read_text())["submissions"]) == 1
    assert time.monotonic() - began < 60

    # Asked to, the changed task runs again: the new tests' reward, the other task's kept.
    lines = run_rollouts(replace(request, rerun_changed=True))
    assert [(line["task"], line["reward"]) for line in lines if line["task"] == "changed"] == [
        ("changed", 0.25)
    ]
    statuses = {s["task"]: s for s in cli_json("status", str(run_dir))}
    assert (statuses["changed"]["reward"], statuses["kept"]["reward"]) == (0.25, 1.0)
    # The old trial is still there, exported as one that does not count.
    out = tmp_path / "all.jsonl"
    cli("export", str(run_dir), "--out", str(out))
    exported = [json.loads(text) for text in out.read_text().splitlines()]
    assert sorted((x["task"], x["reward"], x["counts"]) for x in exported) == [
        ("changed", 0.25, True),
        ("changed", 1.0, False),
        ("kept", 1.0, True),
    ]
    # The same request again now continues the run as it is: nothing changed since.
    again = run_rollouts(request)
    assert {line["task"]: line["reward"] for line in again} == {"kept": 1.0, "changed": 0.25}
