"""The outcomes index: status reads what the workers noted, and the trial's folder wherever the
index has no whole entry of today's rules for a trial that is still there."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harbor.trial.errors import AgentTimeoutError

from harbor_hpc.results.classify import Outcome
from harbor_hpc.results.outcomes import RunTrials, note_outcome, read_outcome
from harbor_hpc.results.record import Chunk, Marker, RunPaths, Unit, load_run, write_marker
from harbor_hpc.results.status import attempt_statuses
from tests.results.test_classify import harbor_result
from tests.results.test_status import record_with, submit

JOB = "41_0"


def ended(run_dir: Path, trial: str, task: str, result: dict[str, object]) -> Marker:
    """A trial that ended as a worker leaves it: marker, folder, result.json."""
    marker = Marker(trial, task, 0, 1, JOB, "node-1", 7, f"2026-01-01T{trial}")
    write_marker(run_dir, marker)
    RunPaths(run_dir).trial(trial).mkdir(parents=True)
    (RunPaths(run_dir).trial(trial) / "result.json").write_text(json.dumps(result))
    return marker


def noted(run_dir: Path, marker: Marker) -> None:
    """What the worker notes once the trial has ended."""
    outcome = read_outcome(run_dir, None, marker)
    assert outcome is not None
    note_outcome(run_dir, marker, outcome, group_readable=False, reward_key=None)


def seen(run_dir: Path) -> dict[str, tuple[str, str | None, float | None]]:
    found = attempt_statuses(run_dir, load_run(run_dir), set())
    return {s.task: (s.state, s.failure, s.reward) for s in found}


def index_lines(run_dir: Path) -> list[Path]:
    return sorted(RunPaths(run_dir).outcomes.iterdir())


def a_run(tmp_path: Path, tasks: list[str]) -> Path:
    run_dir = record_with(tmp_path, tasks)
    submit(run_dir, Chunk([Unit(task, 0) for task in tasks], JOB))
    return run_dir


def test_status_takes_the_noted_outcome_and_reads_the_folders_of_the_rest(
    tmp_path: Path,
) -> None:
    run_dir = a_run(tmp_path, ["solved", "unnoted"])
    solved = ended(run_dir, "t1", "solved", harbor_result(tmp_path, rewards={"reward": 1}))
    noted(run_dir, solved)
    timeout = harbor_result(tmp_path, exception=AgentTimeoutError("timed out after 2 s"))
    ended(run_dir, "t2", "unnoted", timeout)  # a worker killed before its note
    [index] = index_lines(run_dir)
    assert index.name == f"{JOB}.node-1.7.jsonl"  # one file per worker process
    assert oct(index.stat().st_mode & 0o777) == "0o600"  # as private as the run

    # The noted trial's folder is not read: its result.json, made unreadable, is not missed.
    (RunPaths(run_dir).trial("t1") / "result.json").chmod(0)
    assert seen(run_dir) == {
        "solved": ("done", None, 1.0),
        "unnoted": ("failed", "timeout", None),
    }
    # Without the index, the folders are the truth, as they always were.
    shutil.rmtree(RunPaths(run_dir).outcomes)
    assert seen(run_dir)["solved"] == ("failed", "infrastructure", None)  # unreadable result


def test_an_entry_is_taken_only_while_it_holds(tmp_path: Path) -> None:
    run_dir = a_run(tmp_path, ["gone", "other-rules", "clash", "cut"])
    result = harbor_result(tmp_path, rewards={"reward": 1})
    for task in ("gone", "other-rules", "clash", "cut"):
        noted(run_dir, ended(run_dir, f"t-{task}", task, result))
    [index] = index_lines(run_dir)
    truth = {json.loads(line)["marker"]["task"]: line for line in index.read_text().splitlines()}
    wrong = {task: json.loads(line) for task, line in truth.items()}
    for entry in wrong.values():
        entry["outcome"]["reward"] = 0.5  # what the files do not say: never shown below
    wrong["other-rules"]["rules"] = "an older harbor-hpc"
    # Read before the true file: another entry of the same trial says otherwise.
    (RunPaths(run_dir).outcomes / "0-other.jsonl").write_text(
        "".join(json.dumps(wrong[task]) + "\n" for task in ("other-rules", "clash"))
    )
    # The true "other-rules" entry is gone; "cut" is cut short, as by a killed worker.
    kept = [truth["gone"], truth["clash"]]
    index.write_text("".join(line + "\n" for line in kept) + truth["cut"][:40])
    # A folder deleted after its note is a lost result, as without the index.
    shutil.rmtree(RunPaths(run_dir).trial("t-gone"))

    assert seen(run_dir) == {
        "gone": ("failed", "infrastructure", None),
        "other-rules": ("done", None, 1.0),
        "clash": ("done", None, 1.0),
        "cut": ("done", None, 1.0),
    }


def test_a_line_a_killed_worker_half_wrote_is_skipped_and_the_next_one_read(
    tmp_path: Path,
) -> None:
    run_dir = a_run(tmp_path, ["first", "requeued"])
    result = harbor_result(tmp_path, rewards={"reward": 1})
    first = ended(run_dir, "t1", "first", result)
    noted(run_dir, first)
    [index] = index_lines(run_dir)
    whole = index.read_bytes()
    index.write_bytes(whole[: len(whole) // 2])  # killed mid-write
    requeued = ended(run_dir, "t2", "requeued", result)
    noted(run_dir, requeued)  # glued to the half line: that line is lost, not misread
    (RunPaths(run_dir).trial("t1") / "result.json").write_text(
        json.dumps(harbor_result(tmp_path, rewards={"reward": 0}))
    )
    assert seen(run_dir) == {"first": ("done", None, 0.0), "requeued": ("done", None, 1.0)}
    noted(run_dir, requeued)  # a whole line after them
    trials = RunTrials(run_dir, reward_key=None)
    assert trials.noted("t1") is None
    assert trials.noted("t2") == Outcome(None, None, 1.0, {"reward": 1.0}, True)


def test_an_entry_read_by_another_reward_key_is_not_taken(tmp_path: Path) -> None:
    # A worker that read {"c": 1, "s": 0.5} by the key "c" noted reward 1; a reader of the run
    # by the default rule (no key) reads the folder again: several rewards, none `reward`.
    run_dir = a_run(tmp_path, ["two-keys"])
    marker = ended(run_dir, "t1", "two-keys", harbor_result(tmp_path, rewards={"c": 1, "s": 0.5}))
    outcome = read_outcome(run_dir, "c", marker)
    assert outcome is not None and outcome.reward == 1.0
    note_outcome(run_dir, marker, outcome, group_readable=False, reward_key="c")
    assert RunTrials(run_dir, reward_key="c").noted("t1") == outcome
    assert RunTrials(run_dir, reward_key=None).noted("t1") is None
    assert seen(run_dir) == {"two-keys": ("failed", "verifier", None)}
