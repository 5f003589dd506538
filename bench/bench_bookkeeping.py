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

The run carries the outcomes index as the workers write it (results/outcomes.py); --no-index
times it as a run made before the index. `cpu s` is the process's user and system time, which
a busy machine's other work does not stretch as it does the wall time.

Goals (issue 50): each under 10 s and under 500 MB resident; with 2 ms per file operation,
under 60 s.

Figures, 10,000 x 8 (80,000 trials), on a shared 2-core machine (load 6 to 11 from other work:
wall times are noisy, CPU times less so): before (8e47b81) and after the outcomes index, the
status table printed line by line, export reading each result.json once, task.toml read ahead:

    command                       before: s  cpu s   MB    after: s  cpu s   MB   +2 ms/op
    status                           56.9    49.1   328        7.7    3.7   176     24.2
    status --json                    18.0    15.7   220       11.3    3.9   179     17.0
    export full                     102.3    43.0   219       55.9   30.2   195    105.4
    export harbor-rl                 55.9       -   219       40.7   25.1   196     99.4
    export nemo-gym                  94.3    41.4   219       25.3   25.5   194     96.4
    resubmit --failed --dry-run      48.8    17.4   201        4.8    4.4   198     40.4
    submit --dry-run                  2.2     2.1    69        1.7    1.7    67     50.2

With 2 ms per file operation the code before read every trial's files one after the other,
too slow to time at 80,000 trials; at 500 x 8 (4,000 trials), in seconds:

    command                       before   after
    status                         149.0     6.8
    export full                    222.7    12.5
    resubmit --failed --dry-run    127.3    25.8
    submit --dry-run                19.9    18.1

(the status before: some 3,000 s at 80,000). Without the index (a run made before it) status
reads every trial's folder, several at once: 27.2 s, 22.2 s of CPU. Export stays CPU-bound
(parsing, building and writing 210 MB of lines in one Python process: 25-30 s of CPU), over
the 10 s goal, and with 2 ms per operation over the 60 s one: it reads 80,000 result.json
files, several at a time. strace runs with --seccomp-bpf, so that only the delayed calls stop
the process (without it every call did, which no filesystem does).

Usage: uv run python bench/bench_bookkeeping.py [--tasks 10000] [--attempts 8] [--delay-ms 2]
       [--work DIR] [--keep] [--reuse WORK] [--only COMMAND ...] [--no-index]
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
    index_run(run_dir)
    return tasks_dir, run_dir


def index_run(run_dir: Path) -> None:
    """The run's outcomes index, as the workers write it when each trial ends; made again
    where it holds no entry by today's rules."""
    from harbor_hpc.results.outcomes import RunTrials, note_outcome, read_outcome

    trials = RunTrials(run_dir, reward_key=None)
    if trials.noted(trials.markers[0].trial) is not None:
        return
    shutil.rmtree(run_dir / "outcomes", ignore_errors=True)
    for marker in trials.markers:
        outcome = read_outcome(run_dir, None, marker)
        assert outcome is not None
        note_outcome(run_dir, marker, outcome, group_readable=False, reward_key=None)


def timed(command: list[str], delay_ms: float, scratch: Path) -> tuple[float, float, float, str]:
    """Wall seconds, CPU seconds (user and system: what a busy machine's other work does not
    change) and peak resident MB of `command` (its process tree's largest), with `delay_ms`
    added to each file operation when above 0; and what went wrong, if it did."""
    peak = scratch / "peak.txt"
    wrapped = ["/usr/bin/time", "-f", "%M %U %S", "-o", str(peak)]
    if delay_ms > 0:
        delay = f"delay_enter={int(delay_ms * 1000)}"
        # --seccomp-bpf: the process stops on those calls alone; without it strace stopped it
        # on every call (read, write, futex...), a cost no filesystem adds.
        wrapped += ["strace", "-f", "--seccomp-bpf", "-qq", "-o", "/dev/null"]
        wrapped += ["-e", f"trace={FILE_CALLS}"]
        wrapped += ["-e", f"inject={FILE_CALLS}:{delay}"]
    began = time.perf_counter()
    done = subprocess.run([*wrapped, *command], capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - began
    said = peak.read_text().strip().splitlines()[-1:] if peak.exists() else []
    kilobytes, user, system = said[0].split() if said else ("0", "0", "0")
    problem = "" if done.returncode in (0, 1) else done.stderr.strip()[-300:]
    return elapsed, float(user) + float(system), int(kilobytes) / 1024, problem


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=2.0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run folder")
    parser.add_argument(
        "--reuse", type=Path, default=None, help="time the run folder a --keep left in WORK"
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="time these commands alone (their names below)"
    )
    parser.add_argument(
        "--no-index",
        action="store_true",
        help="without the outcomes index, as runs made before it: every trial's folder read",
    )
    args = parser.parse_args()
    work = args.reuse or Path(tempfile.mkdtemp(prefix="bench-bookkeeping-", dir=args.work))
    index, aside = work / "run" / "outcomes", work / "run" / "outcomes.aside"
    try:
        if args.reuse:
            tasks_dir, run_dir = work / "tasks", work / "run"
            index_run(run_dir)  # once more where it was made by other rules (older code)
        else:
            began = time.perf_counter()
            tasks_dir, run_dir = make_run(work, args.tasks, args.attempts)
            trials = args.tasks * args.attempts
            made = time.perf_counter() - began
            print(f"made {trials} trials of {args.tasks} tasks in {made:.0f} s")
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
        if args.no_index:
            index.rename(aside)
        delayed = f"s, +{args.delay_ms} ms/op"
        print(f"{'command':<30} {'s':>8} {'cpu s':>7} {'MB':>7}   {delayed:>14}")
        for name, command in commands.items():
            if args.only and name not in args.only:
                continue
            plain, cpu, peak, problem = timed(command, 0, work)
            slow, _, _, slow_problem = (
                timed(command, args.delay_ms, work) if args.delay_ms else (0.0, 0.0, 0.0, "")
            )
            print(f"{name:<30} {plain:8.2f} {cpu:7.2f} {peak:7.0f}   {slow:14.2f}", flush=True)
            for said in (problem, slow_problem):
                if said:
                    print(f"  failed: {said}")
    finally:
        if aside.exists():
            aside.rename(index)
        if args.keep or args.reuse:
            shutil.rmtree(work / "new-run", ignore_errors=True)
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
