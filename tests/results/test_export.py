"""Export turns each finished trial into one rollout line, token data included when present."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from harbor.models.agent.context import AgentContext

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.results.export import export_run
from harbor_hpc.results.record import (
    Marker,
    RunPaths,
    RunRecord,
    create_run,
    load_run,
    write_marker,
)
from harbor_hpc.results.status import attempt_statuses
from tests.results.test_classify import harbor_result


def test_one_line_per_finished_trial_with_tokens(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    (tasks / "a").mkdir(parents=True)
    (tasks / "a" / "instruction.md").write_text("do it")
    run_dir = tmp_path / "run"
    create_run(
        run_dir,
        RunRecord(str(tasks), ["a"], "oracle", "m", {}, "x:Y", {}, {"attempts": 2}),
    )
    context = AgentContext(
        n_input_tokens=10,
        n_output_tokens=3,
        rollout_details=[
            {
                "prompt_token_ids": [[1, 2]],
                "completion_token_ids": [[3, 4, 5]],
                "logprobs": [[-0.1, -0.2, -0.3]],
            }
        ],
    )
    paths = RunPaths(run_dir)
    # t1 ran attempt 0, t2 attempt 1 (and never finished: no result.json, no line), t3 ran
    # attempt 0 again (a resubmit --failed, say): only t3 counts for attempt 0.
    for attempt, trial in ((0, "t1"), (1, "t2"), (0, "t3")):
        write_marker(
            run_dir, Marker(trial, "a", attempt, 1, "1_0", socket.gethostname(), 1, f"2026-{trial}")
        )
        paths.trial(trial).mkdir(parents=True)
    result = harbor_result(tmp_path, rewards={"reward": 1}, agent_result=context)
    for trial in ("t1", "t3"):
        (paths.trial(trial) / "result.json").write_text(json.dumps(result))
    (paths.trial("t1") / "agent").mkdir()
    (paths.trial("t1") / "agent" / "trajectory.json").write_text("{}")
    statuses = attempt_statuses(run_dir, load_run(run_dir), set())

    out = tmp_path / "out" / "rollouts.jsonl"
    assert export_run(run_dir, out, statuses, dry_run=True).rollouts == 2
    assert not out.exists()
    assert export_run(run_dir, out, statuses).rollouts == 2
    line, rerun = [json.loads(text) for text in out.read_text().splitlines()]
    assert (rerun["trial"], rerun["attempt"], rerun["counts"]) == ("t3", 0, True)
    assert not line["counts"]  # superseded by t3
    assert line["task"] == "a" and line["trial"] == "t1" and line["attempt"] == 0
    assert line["reward"] == 1.0 and line["rewards"] == {"reward": 1.0}
    assert line["failure"] is None
    assert line["agent"] == "oracle" and line["instruction"] == "do it"
    assert line["trajectory"].endswith("t1/agent/trajectory.json")
    assert line["tokens"]["completion_token_ids"] == [[3, 4, 5]]
    assert line["tokens"]["loss_masks"] == [[1, 1, 1]]
    assert line["tokens"]["logprobs"] == [[-0.1, -0.2, -0.3]]
    assert line["n_input_tokens"] == 10


def test_an_unwritable_out_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    # --out naming a folder used to end in "internal error: IsADirectoryError".
    run_dir = tmp_path / "run"
    create_run(run_dir, RunRecord(str(tmp_path), [], "oracle", None, {}, "x:Y", {}, {}))
    (tmp_path / "out").mkdir()
    with pytest.raises(HarborHpcError, match=r"out: cannot write the rollouts") as refused:
        export_run(run_dir, tmp_path / "out", [])
    assert refused.value.exit_code == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no temporary file
