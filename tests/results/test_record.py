"""The run record round-trips, refuses to overwrite a run, and markers read back in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.results.record import (
    Chunk,
    Marker,
    RunPaths,
    RunRecord,
    Submission,
    Unit,
    create_run,
    load_run,
    new_trial_name,
    update_run,
    write_marker,
)


def sample_record(tmp_path: Path) -> RunRecord:
    return RunRecord(
        tasks_root=str(tmp_path / "tasks"),
        tasks=["a", "b/c"],
        agent="oracle",
        model=None,
        agent_kwargs={},
        environment="harbor_hpc.environment:SingularityEnvironment",
        environment_kwargs={"cache_dir": "/sif"},
        options={"attempts": 2, "executor": "local"},
    )


def test_round_trip_and_units(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    create_run(run_dir, sample_record(tmp_path))
    small, big = {"mem_mb": 1536, "cpus": 1}, {"mem_mb": 17408, "cpus": 1}
    with update_run(run_dir) as record:
        chunks = [Chunk([Unit("a", 0)], "12_0", small), Chunk([Unit("b/c", 0)], "13_0", big)]
        record.submissions.append(Submission(1, "slurm", "node", "t", chunks))
    loaded = load_run(run_dir)
    assert loaded.units() == [Unit("a", 0), Unit("a", 1), Unit("b/c", 0), Unit("b/c", 1)]
    assert loaded.submissions[0].job_ids == ["12", "13"]
    assert loaded.submissions[0].chunks == chunks  # each element's own resources
    assert loaded.task_path("b/c") == tmp_path / "tasks" / "b" / "c"


def test_a_run_sized_as_a_whole_reads_as_sized_per_element(tmp_path: Path) -> None:
    # Before elements were sized per task, a submission recorded one size for all of them.
    create_run(tmp_path, sample_record(tmp_path))
    data = json.loads(RunPaths(tmp_path).record.read_text())
    chunk = {"job": "12_0", "units": [["a", 0]]}
    data["submissions"] = [
        {"number": 1, "executor": "slurm", "host": "h", "submitted_at": "t"}
        | {"resources": {"mem_mb": 2048}, "chunks": [chunk]}
    ]
    RunPaths(tmp_path).record.write_text(json.dumps(data))
    [submission] = load_run(tmp_path).submissions
    assert submission.chunks == [Chunk([Unit("a", 0)], "12_0", {"mem_mb": 2048})]


def test_a_run_folder_is_never_reused(tmp_path: Path) -> None:
    create_run(tmp_path, sample_record(tmp_path))
    with pytest.raises(InputError, match="already holds a run"):
        create_run(tmp_path, sample_record(tmp_path))


def test_a_folder_without_run_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="nosuch: no such folder"):
        load_run(tmp_path / "nosuch")
    with pytest.raises(InputError, match="not a harbor-hpc run folder"):
        load_run(tmp_path)
    RunPaths(tmp_path).record.write_text('{"schema": "other"}')
    with pytest.raises(InputError, match="not a harbor-hpc run record"):
        load_run(tmp_path)


def test_markers_oldest_first_and_broken_ones_skipped(tmp_path: Path) -> None:
    for trial, started in (("t2", "2026-01-01T00:00:02"), ("t1", "2026-01-01T00:00:01")):
        write_marker(tmp_path, Marker(trial, "a", 0, 1, "5_0", "h", 1, started))
    (RunPaths(tmp_path).markers / "broken.json").write_text("{")
    assert [m.trial for m in RunTrials(tmp_path, reward_key=None).markers] == ["t1", "t2"]


def test_trial_names_are_fresh() -> None:
    names = {new_trial_name("dir/some-task", 3) for _ in range(20)}
    assert len(names) == 20
    assert all(name.startswith("some-task__a3-") for name in names)


def test_differences_name_what_would_run_differently(tmp_path: Path) -> None:
    record = sample_record(tmp_path)
    same = sample_record(tmp_path)
    same.options["partition"] = "other"  # where it runs does not change what runs
    assert record.differences(same) == []
    other = sample_record(tmp_path)
    other.agent = "nop"
    other.options["attempts"] = 3
    assert record.differences(other) == ["agent", "attempts"]
