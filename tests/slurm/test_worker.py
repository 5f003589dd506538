"""A requeued element resumes its chunk: finished trials are skipped, cut-off ones rerun."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

import pytest

from harbor_hpc.results.record import Marker, RunPaths, RunRecord, Unit, write_marker
from harbor_hpc.slurm.secrets import is_secret, redact_secrets_only
from harbor_hpc.slurm.worker import (
    LOCAL_COST_MAP,
    ChunkWorker,
    agent_config_fields,
    use_local_cost_map,
)
from tests.results.test_classify import harbor_result


def test_units_left_after_a_requeue(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)

    def started(
        trial: str,
        task: str,
        submission: int,
        result: dict[str, object] | None,
        **stopped: str,
    ) -> None:
        host = socket.gethostname()
        marker = Marker(trial, task, 0, submission, "9_0", host, 1, f"2026-{trial}", **stopped)
        write_marker(run_dir, marker)
        paths.trial(trial).mkdir(parents=True)
        if result is not None:
            (paths.trial(trial) / "result.json").write_text(json.dumps(result))

    solved = harbor_result(tmp_path, rewards={"reward": 1})
    failed = harbor_result(tmp_path, exception=RuntimeError("agent crashed"))
    cancelled = harbor_result(tmp_path, exception=asyncio.CancelledError())
    started("t1", "finished-here", 2, failed)  # failed in this submission: keep
    started("t2", "cut-off", 2, None)  # killed midway: run again
    started("t3", "done-before", 1, solved)  # done in an earlier submission: never again
    started("t4", "failed-before", 1, failed)  # resubmitted with --failed: run again
    started("t5", "cancelled", 2, cancelled)  # the requeue signal cancelled it: run again
    # The requeue's SIGTERM killed the agent, and the verifier then gave reward 0: run again.
    unsolved = harbor_result(tmp_path, rewards={"reward": 0})
    started("t6", "cut-short", 2, unsolved, terminated_by="SIGTERM")
    # The container could not even start while the job was being stopped: run again.
    started("t7", "stopped", 2, None, error_type="ContainerStartFailed", terminated_by="SIGTERM")
    # Done in an earlier submission, but its task changed and submission 2 runs it again.
    started("t8", "changed", 1, solved)
    names = ("finished-here", "cut-off", "done-before", "failed-before", "cancelled")
    units = [Unit(t, 0) for t in (*names, "cut-short", "stopped", "changed", "new")]
    record = RunRecord(
        str(tmp_path), [u.task for u in units], "oracle", None, {}, "env", {}, {},
        rerun_from={"changed": 2},
    )  # fmt: skip
    worker = ChunkWorker(str(run_dir), submission=2, concurrency=2)
    left = worker.units_left(run_dir, record, units)
    assert [u.task for u in left] == [
        "cut-off",
        "failed-before",
        "cancelled",
        "cut-short",
        "stopped",
        "changed",
        "new",
    ]


def test_the_users_cost_map_choice_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers use litellm's own cost map (tests/slurm/test_runs.py sees it in a job), unless
    # the user's environment says otherwise.
    monkeypatch.setenv(LOCAL_COST_MAP, "False")
    use_local_cost_map()
    assert os.environ[LOCAL_COST_MAP] == "False"
    monkeypatch.delenv(LOCAL_COST_MAP)
    use_local_cost_map()
    assert os.environ[LOCAL_COST_MAP] == "True"


def record_of(agent: str) -> RunRecord:
    return RunRecord(
        tasks_root="/tasks", tasks=["t"], agent=agent, model="openai/policy", agent_kwargs={},
        environment="harbor_hpc.environment:SingularityEnvironment", environment_kwargs={},
        options={}, agent_env=["OPENAI_API_KEY"],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("agent", "in_container"),
    [
        ("terminus-2", False),
        ("oracle", False),
        ("tests.support.probe_agent:ProbeAgent", False),
        ("claude-code", True),
        ("tests.support.installed_agent:InstalledAgent", True),
        ("no-such-agent", False),
    ],
)
def test_only_an_agent_in_the_container_gets_its_variables_there(
    agent: str, in_container: bool
) -> None:
    """Harbor hands an agent's `env` to every command in the container (terminus-2's tmux
    included): an agent that runs here gets none, and finds them in the job's environment."""
    fields = agent_config_fields(record_of(agent))
    assert ("env" in fields) == in_container
    if in_container:
        assert fields["env"] == {"OPENAI_API_KEY": "${OPENAI_API_KEY}"}  # never the value


def test_harbors_redaction_leaves_what_is_no_secret(tmp_path: Path) -> None:
    """What a server without keys is given (`none`, `EMPTY`, short values) is no secret: Harbor's
    trial, which rewrites each value it collects in every file of the trial, keeps them."""
    import harbor.trial.trial as trial

    assert [v for v in ("none", "EMPTY", "dummy", "x", "1234567", "sk-no-key-required") if
            is_secret(v)] == []  # fmt: skip
    assert is_secret("sk-hh-9f3c1e7a5b2d") and is_secret("s3cr3t-2f9a")
    redact_secrets_only()
    redact_secrets_only()  # once only, however often a worker asks
    text = "--network none, key sk-hh-9f3c1e7a5b2d, EMPTY\n"
    secrets = ["sk-hh-9f3c1e7a5b2d", "EMPTY", "none"]
    assert trial.scrub_file_text(tmp_path / "a.txt", text, secrets) == (
        "--network none, key [REDACTED], EMPTY\n"
    )
