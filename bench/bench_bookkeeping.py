"""Bookkeeping at scale: how long `status`, `export`, `resubmit` and `submit` take, and how much
memory, over a run of 10,000 tasks x 8 attempts (an evaluation's size; a trainer's step is a
fiftieth of it), as whole processes, the way a user runs them.

The bench makes the run folder first: a task folder per task (task.toml, instruction, tests,
solution, one .sif named by all), and per attempt a trial folder as Harbor writes one for
terminus-2 (config.json, result.json from Harbor's own TrialResult model with two turns of token
data, trial.log, agent/, verifier/reward.txt), its marker, and the agent's model-calls.json;
most attempts are done (reward 1 or 0), some failed (the agent's time, the model server), so
that `resubmit --failed` has work. Then it times each command, and again with every file
operation of the command 2 ms slower (strace's syscall delay injection on openat, stat, statx,
newfstatat, getdents64, rename and unlink: what a shared filesystem's round trip costs).

Goals (issue 50): each under 10 s and under 500 MB resident; with 2 ms per file operation,
under 60 s.

Usage: uv run python bench/bench_bookkeeping.py [--tasks 10000] [--attempts 8] [--delay-ms 2]
       [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FILE_CALLS = "openat,stat,statx,newfstatat,lstat,getdents64,rename,unlink,access,readlink"


def result_template() -> dict[str, Any]:
    """A result.json as Harbor serialises a terminus-2 trial that ended, with two turns."""
    from harbor.models.agent.context import AgentContext
    from harbor.models.trial.config import TaskConfig, TrialConfig
    from harbor.models.trial.result import AgentInfo, TimingInfo, TrialResult
    from harbor.models.verifier.result import VerifierResult

    config = TrialConfig(task=TaskConfig(path=Path("/tasks/t")), trials_dir=Path("/trials"))
    prompts = [list(range(40)), list(range(60))]
    completions = [list(range(40, 50)), list(range(60, 70))]
    result = TrialResult(
        task_name="t",
        trial_name="TRIAL",
        trial_uri="file:///trials/TRIAL",
        task_id=config.task.get_task_id(),
        task_checksum="0",
        config=config,
        agent_info=AgentInfo(name="terminus-2", version="2.0.0"),
        agent_result=AgentContext(
            rollout_details=[
                {
                    "prompt_token_ids": prompts,
                    "completion_token_ids": completions,
                    "logprobs": [[-0.5] * 10, [-0.25] * 10],
                }
            ]
        ),
        verifier_result=VerifierResult(rewards={"reward": 1.0}),
        agent_execution=TimingInfo(),
    )
    data: dict[str, Any] = json.loads(result.model_dump_json())
    return data


def calls(tokens: bool, cut_off: bool) -> dict[str, Any]:
    answered = {"started_at": "2026-11-29T00:00:00+00:00", "seconds": 0.5, "end": "answered"}
    entries = [{**answered, "tokens": tokens}, {**answered, "tokens": tokens}]
    if cut_off:
        entries.append({**answered, "end": "cut_off", "seconds": 30.0, "tokens": None})
    return {"schema": "harbor-hpc/model-calls/v1", "calls": entries}


def make_run(work: Path, tasks: int, attempts: int) -> tuple[Path, Path]:
    """The tasks folder and the run folder; every file written as plainly as can be (the
    bench measures reading them)."""
    tasks_dir, run_dir = work / "tasks", work / "run"
    sif = work / "image.sif"
    sif.write_bytes(b"")  # only its presence is asked by a dry run
    template = result_template()
    names = [f"task-{number:05d}" for number in range(tasks)]
    for name in names:
        task = tasks_dir / name
        for folder in ("environment", "tests", "solution"):
            (task / folder).mkdir(parents=True)
        (task / "task.toml").write_text(
            f'schema_version = "1.4"\n\n[agent]\ntimeout_sec = 60\n\n[environment]\n'
            f'docker_image = "{sif}"\nmemory_mb = 512\ncpus = 1\n'
        )
        (task / "instruction.md").write_text("Write 42 into /tmp/answer.\n")
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho 42 > /tmp/answer\n")
    for folder in ("trials", "markers", "submitit"):
        (run_dir / folder).mkdir(parents=True)
    units, trial_number = [], 0
    for name in names:
        for attempt in range(attempts):
            trial = f"{name}__a{attempt}-{trial_number:06x}"
            trial_number += 1
            units.append([name, attempt])
            kind = trial_number % 20  # 1 in 20 timed out on the server, 1 in 20 unsolved
            result = dict(template, trial_name=trial, task_name=name)
            if kind == 0:
                result["exception_info"] = {
                    "exception_type": "AgentTimeoutError",
                    "exception_message": "Agent execution timed out after 60.0 seconds",
                    "exception_traceback": "",
                    "occurred_at": "2026-11-29T00:00:00",
                }
            if kind == 1:
                result["verifier_result"] = {"rewards": {"reward": 0.0}}
            trial_dir = run_dir / "trials" / trial
            (trial_dir / "agent").mkdir(parents=True)
            (trial_dir / "verifier").mkdir()
            (trial_dir / "result.json").write_text(json.dumps(result))
            (trial_dir / "config.json").write_text(json.dumps(template["config"]))
            (trial_dir / "trial.log").write_text("started\nended\n")
            (trial_dir / "verifier" / "reward.txt").write_text("1\n")
            (trial_dir / "model-calls.json").write_text(json.dumps(calls(True, kind == 0)))
            marker = {
                "trial": trial, "task": name, "attempt": attempt, "submission": 1,
                "job": str(1000 + trial_number // 64), "host": "elsewhere", "pid": 1,
                "started_at": f"2026-11-29T00:{trial_number % 60:02d}:00+00:00",
            }  # fmt: skip
            (run_dir / "markers" / f"{trial}.json").write_text(json.dumps(marker))
    chunks = [
        {"job": str(1000 + index), "units": units[index * 64 : (index + 1) * 64], "resources": {}}
        for index in range((len(units) + 63) // 64)
    ]
    record = {
        "schema": "harbor-hpc/run/v1",
        "tasks_root": str(tasks_dir),
        "tasks": names,
        "agent": "terminus-2",
        "model": "openai/policy",
        "agent_kwargs": {"collect_rollout_details": True},
        "agent_env": [],
        "environment": "harbor_hpc.environment:SingularityEnvironment",
        "environment_kwargs": {},
        "options": {"attempts": attempts, "executor": "local", "concurrency": 8},
        "image_problems": {},
        "submissions": [
            {
                "number": 1, "executor": "local", "host": "elsewhere",
                "submitted_at": "2026-11-29T00:00:00+00:00", "chunks": chunks,
            }
        ],
        "created_at": "2026-11-29T00:00:00+00:00",
        "updated_at": "2026-11-29T00:00:00+00:00",
    }  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(record))
    run_dir.chmod(0o700)
    return tasks_dir, run_dir


def timed(command: list[str], delay_ms: float, scratch: Path) -> tuple[float, float, str]:
    """Wall seconds and peak resident MB of `command` (its process tree's largest), with
    `delay_ms` added to each file operation when above 0; and what went wrong, if it did."""
    peak = scratch / "peak.txt"
    wrapped = ["/usr/bin/time", "-f", "%M", "-o", str(peak)]
    if delay_ms > 0:
        delay = f"delay_enter={int(delay_ms * 1000)}"
        wrapped += ["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={FILE_CALLS}"]
        wrapped += ["-e", f"inject={FILE_CALLS}:{delay}"]
    began = time.perf_counter()
    done = subprocess.run([*wrapped, *command], capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - began
    kilobytes = peak.read_text().strip().splitlines()[-1:] if peak.exists() else []
    problem = "" if done.returncode in (0, 1) else done.stderr.strip()[-300:]
    return elapsed, int(kilobytes[0]) / 1024 if kilobytes else 0.0, problem


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-bookkeeping-", dir=args.work))
    try:
        began = time.perf_counter()
        tasks_dir, run_dir = make_run(work, args.tasks, args.attempts)
        trials = args.tasks * args.attempts
        print(f"made {trials} trials of {args.tasks} tasks in {time.perf_counter() - began:.0f} s")
        cli = [sys.executable, "-m", "harbor_hpc"]
        out = work / "out.jsonl"
        commands = {
            # The floor: Python and the CLI starting, whose imports are file operations too.
            "startup (status --help)": [*cli, "status", "--help"],
            "status": [*cli, "status", str(run_dir)],
            "status --json": [*cli, "status", str(run_dir), "--json"],
            "export full": [*cli, "export", str(run_dir), "--out", str(out)],
            "export harbor-rl": [
                *cli, "export", str(run_dir), "--out", str(out), "--format", "harbor-rl"
            ],
            "export nemo-gym": [
                *cli, "export", str(run_dir), "--out", str(out), "--format", "nemo-gym"
            ],
            "resubmit --failed --dry-run": [
                *cli, "resubmit", str(run_dir), "--failed", "--dry-run", "--json"
            ],
            "submit --dry-run": [
                *cli, "submit", str(tasks_dir), "--agent", "oracle", "--executor", "local",
                "--run-dir", str(work / "new-run"), "--dry-run", "--json",
            ],
        }  # fmt: skip
        print(f"{'command':<30} {'s':>8} {'MB':>7}   {'s, +' + str(args.delay_ms) + ' ms/op':>14}")
        for name, command in commands.items():
            plain, peak, problem = timed(command, 0, work)
            slow, _, slow_problem = (
                timed(command, args.delay_ms, work) if args.delay_ms else (0.0, 0.0, "")
            )
            print(f"{name:<30} {plain:8.2f} {peak:7.0f}   {slow:14.2f}", flush=True)
            for said in (problem, slow_problem):
                if said:
                    print(f"  failed: {said}")
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
