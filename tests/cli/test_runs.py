"""`harbor-hpc submit` as users run it: a fresh process that reads ./harbor-hpc.toml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harbor_hpc.cli.app import info, warn
from harbor_hpc.containers.limits import ONE_ID, write_limits
from harbor_hpc.results.record import Marker, RunPaths, RunRecord, create_run, write_marker
from tests.support.cli import cli
from tests.support.probe_agent import AGENT
from tests.support.sample_tasks import make_task


def test_submit_takes_time_min_from_the_config(tmp_path: Path) -> None:
    # The config key time_min was accepted but never used: elements got the derived time.
    sif = tmp_path / "there.sif"
    sif.write_text("")
    make_task(tmp_path / "tasks", "a", image=str(sif), agent_timeout_sec=60)
    (tmp_path / "harbor-hpc.toml").write_text("time_min = 240\n")
    env = {k: v for k, v in os.environ.items() if k != "HARBOR_HPC_CONFIG"}
    command = [sys.executable, "-m", "harbor_hpc", "submit", "tasks", "--agent", "oracle"]
    command += ["--executor", "local", "--run-dir", "run", "--dry-run", "--json"]

    from_config = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert from_config.returncode == 0, from_config.stderr
    [group] = json.loads(from_config.stdout)["groups"]
    assert group["resources"]["time_min"] == 240

    flag = subprocess.run(
        [*command, "--time", "30"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    [group] = json.loads(flag.stdout)["groups"]
    assert group["resources"]["time_min"] == 30  # a flag wins
    assert not (tmp_path / "run").exists()


def test_status_shows_names_and_messages_as_text(tmp_path: Path) -> None:
    # Rich markup in user data: `[v2]` vanished from the task name, and a message holding
    # `[/opt/x]` ended `status` with "internal error: MarkupError".
    task = "data[v2]/t"
    run_dir = tmp_path / "run"
    create_run(run_dir, RunRecord(str(tmp_path), [task], "oracle", None, {}, "x:Y", {}, {}))
    message = "cannot open [/opt/x]"
    marker = Marker("t__a0-1", task, 0, 1, None, "elsewhere", 1, "now", "OSError", message)
    write_marker(run_dir, marker)
    env = {**os.environ, "COLUMNS": "300"}  # one table row per line, nothing folded
    shown = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", "status", str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert task in shown.stdout and message in shown.stdout


def test_status_reads_at_80_columns(tmp_path: Path) -> None:
    # The message column wrapped to ~30 lines per row at 80 columns.
    tasks = ["skill_based/mixed/scientific_computing/solve-the-heat-equation", "b", "c"]
    run_dir = tmp_path / "run"
    create_run(run_dir, RunRecord(str(tmp_path), tasks, "oracle", None, {}, "x:Y", {}, {}))
    message = "cannot start: " + "the image says no " * 8
    write_marker(run_dir, Marker("t__a0-1", tasks[0], 0, 1, None, "h", 1, "now", "E", message))
    # A trial that ended with its container weaker than Docker's: the long limit is wrapped.
    write_marker(run_dir, Marker("c__a0-1", "c", 0, 1, None, "h", 1, "now"))
    trial = RunPaths(run_dir).trial("c__a0-1")
    trial.mkdir(parents=True)
    (trial / "result.json").write_text('{"verifier_result": {"rewards": {"reward": 1}}}')
    write_limits(trial, [ONE_ID])

    def status(*args: str) -> str:
        env = {**os.environ, "COLUMNS": "80"}
        command = [sys.executable, "-m", "harbor_hpc", "status", str(run_dir), *args]
        shown = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        assert shown.returncode == 0, shown.stderr
        return shown.stdout

    lines = status().splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    why = lines[lines.index(f"{tasks[0]} #0") + 1]  # the message, cut to one line
    assert why.startswith("  E: cannot start: the image says no") and why.endswith("…")
    assert lines[lines.index("b #0") + 1] == "  never submitted"
    assert sum("environment" in line for line in lines) == 2  # the class, and the counts
    assert "1 attempt(s) ran weaker than in Docker: one id in the container" in " ".join(lines)
    verbose = status("-v")
    assert " ".join(message.split()) in " ".join(verbose.split()) and "t__a0-1" in verbose
    [first, second, third] = json.loads(status("--json"))
    assert (third["state"], third["reward"], third["limits"]) == ("done", 1.0, [ONE_ID])
    assert first == {
        "task": tasks[0],
        "attempt": 0,
        "trial": "t__a0-1",
        "state": "failed",
        "reward": None,
        "failure": "environment",
        "message": "E: " + " ".join(message.split()),
        "limits": [],
        "trainable": False,
    }
    assert third["trainable"] is True
    assert second["message"] == "never submitted"


def test_warnings_and_info_show_text_as_is(capsys: pytest.CaptureFixture[str]) -> None:
    warn("data[v2]/t: cannot open [/opt/x]")
    info("wrote [bold]x")
    assert capsys.readouterr().err == "warning: data[v2]/t: cannot open [/opt/x]\nwrote [bold]x\n"


def test_submit_uses_the_store_convert_uses(tmp_path: Path) -> None:
    # With both $HARBOR_HPC_CACHE and the config's cache_dir set, convert filled the first and
    # submit sent trials to the second, where every image was converted again.
    make_task(tmp_path / "tasks", "a", image=str(tmp_path / "not-yet.sif"))  # so nothing runs
    (tmp_path / "harbor-hpc.toml").write_text('cache_dir = "from-config"\n')
    env = {k: v for k, v in os.environ.items() if k != "HARBOR_HPC_CONFIG"}
    env["HARBOR_HPC_CACHE"] = str(tmp_path / "from-env")
    command = [sys.executable, "-m", "harbor_hpc", "submit", "tasks", "--agent", "oracle"]
    command += ["--executor", "local", "--run-dir", "run", "--json"]
    submitted = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert submitted.returncode == 0, submitted.stderr
    assert json.loads(submitted.stdout)["job_ids"] == []
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    kwargs = record["environment_kwargs"]
    assert kwargs["singularity_image_cache_dir"] == str(tmp_path / "from-env")


def test_submit_collects_tokens_unless_told_not_to(tmp_path: Path) -> None:
    # Tokens reached an export only when the user knew to ask for them.
    make_task(tmp_path / "tasks", "a", image=str(tmp_path / "not-yet.sif"))  # so nothing runs
    run = ["submit", str(tmp_path / "tasks"), "--agent", AGENT, "--executor", "local", "--json"]
    submitted = json.loads(cli(*run, "--run-dir", str(tmp_path / "run")).stdout)
    assert submitted["agent_kwargs"] == {"collect_rollout_details": True}
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["agent_kwargs"] == {"collect_rollout_details": True}
    off = cli(
        *run, "--run-dir", str(tmp_path / "off"), "--agent-kwarg", "collect_rollout_details=false"
    )
    assert json.loads(off.stdout)["agent_kwargs"] == {"collect_rollout_details": False}
    oracle = cli(*run[:3], "oracle", *run[4:], "--run-dir", str(tmp_path / "oracle"), "--dry-run")
    assert json.loads(oracle.stdout)["agent_kwargs"] == {}  # it calls no model
