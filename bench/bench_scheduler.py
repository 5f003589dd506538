"""What a run costs slurmctld: the RPCs of one user's `submit` and of following the run to its end
(`resubmit --wait` of the same run, which queues nothing new but the waves a limit held back),
read from `sdiag`'s per-user and per-message-type counts before and after each, as an ordinary
user, with the wall time, the elements and the waves they went out in.

Run it against a cluster of its own (`--slurm-conf`, e.g. CI's cluster with low limits,
/etc/slurm-limits/slurm.conf: MaxArraySize=100, MaxSubmitJobs=20), so that the per-type counts
are this run's (sdiag's per-user counts are this user's everywhere; its per-type counts include
the nodes' own messages, which every job costs whatever submitted it).

Goal (issue 50): at most 12 RPCs a minute of the user's while a run goes on, whatever its size.

Usage: uv run python bench/bench_scheduler.py --sif SIF [--tasks 250] [--attempts 4]
       [--tasks-per-job 5] [--concurrency 4] [--slurm-conf /etc/slurm-limits/slurm.conf]
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_environment import add_image_arguments, server_sif

from tests.support.sample_tasks import make_task

# `sdiag` lines: `hpcuser ( 1001) count:146 ave_time:... total_time:...`, and the same for
# message types (`REQUEST_JOB_INFO ( 2003) count:...`).
_COUNT = re.compile(r"^\s*(\S+)\s*\(\s*(\d+)\)\s+count:(\d+)", re.MULTILINE)


def sdiag(env: dict[str, str]) -> tuple[Counter[str], Counter[str]]:
    """The controller's RPC counts so far: by message type, by user."""
    text = subprocess.run(["sdiag"], env=env, capture_output=True, text=True, check=True).stdout
    by_type, _, by_user = text.partition("Remote Procedure Call statistics by user")
    by_type = by_type.partition("Remote Procedure Call statistics by message type")[2]
    return (
        Counter({name: int(count) for name, _, count in _COUNT.findall(by_type)}),
        Counter({name: int(count) for name, _, count in _COUNT.findall(by_user)}),
    )


def step(argv: list[str], env: dict[str, str], user: str) -> tuple[float, Counter[str], int]:
    """Run `harbor-hpc ARGV`; its wall time, the RPCs it cost by type, and the user's RPCs."""
    types_before, users_before = sdiag(env)
    began = time.perf_counter()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "harbor-hpc"), *argv],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"harbor-hpc {' '.join(argv)} failed:\n{done.stderr}")
    print(done.stderr.strip())
    types_after, users_after = sdiag(env)
    # sdiag's own call is one REQUEST_STATS_INFO of the user's: not the step's.
    return seconds, types_after - types_before, users_after[user] - users_before[user] - 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=250)
    parser.add_argument("--attempts", type=int, default=4)
    parser.add_argument("--tasks-per-job", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--slurm-conf", default=os.environ.get("SLURM_CONF"))
    parser.add_argument("--work", type=Path, default=Path.home())
    add_image_arguments(parser)
    args = parser.parse_args(argv)
    sif = server_sif(args)
    if sif is None:
        return 2
    env = {**os.environ, **({"SLURM_CONF": args.slurm_conf} if args.slurm_conf else {})}
    user = getpass.getuser()
    with tempfile.TemporaryDirectory(prefix="bench-scheduler-", dir=args.work) as folder:
        tasks = Path(folder) / "tasks"
        for number in range(args.tasks):
            make_task(tasks, f"t{number:04d}", image=str(sif), agent_timeout_sec=120)
        run_dir = Path(folder) / "run"
        shape = ["--attempts", str(args.attempts), "--tasks-per-job", str(args.tasks_per_job)]
        shape += ["--concurrency", str(args.concurrency)]
        queue = step(
            ["submit", str(tasks), "--agent", "oracle", "--run-dir", str(run_dir),
             "--executor", "slurm", *shape],
            env, user,
        )  # fmt: skip
        follow = step(["resubmit", str(run_dir), "--wait"], env, user)
        statuses = json.loads(
            subprocess.run(
                [str(Path(sys.executable).parent / "harbor-hpc"), "status", str(run_dir), "--json"],
                env=env, capture_output=True, text=True, check=True,
            ).stdout
        )  # fmt: skip
        record = json.loads((run_dir / "run.json").read_text())
    trials = len(statuses)
    rewards = Counter(s["reward"] for s in statuses)
    assert rewards == {1.0: trials}, f"not every trial scored 1: {rewards}"
    elements = sum(len(sub["chunks"]) for sub in record["submissions"])
    arrays = sum(len(sub["job_ids"]) for sub in record["submissions"])
    print(f"\n{trials} oracle trials in {elements} elements ({arrays} array jobs), "
          f"as {user}, SLURM_CONF={args.slurm_conf or '(default)'}")  # fmt: skip
    for name, (seconds, types, mine) in (("submit", queue), ("follow (--wait)", follow)):
        per_minute = mine / seconds * 60
        print(f"  {name:16} {seconds:7.1f} s  {mine:5d} RPCs of {user}  {per_minute:6.1f} a minute")
        shown = ", ".join(f"{t} {n}" for t, n in types.most_common(8))
        print(f"  {'':16} by type (every user, the nodes' too): {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
