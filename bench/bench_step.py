"""A trainer's step run for real, as an ordinary user, through `harbor_hpc.api.run_rollouts`:
`--tasks` x `--attempts` rollouts (a batch of GRPO groups) of a short oracle task on the
three-node cluster .ci/provision.sh makes, once with `executor="slurm"` (array elements of
`--concurrency` trials) and once with `executor="ray"` (a `harbor-hpc ray up` cluster over the
three nodes, `--ray-concurrency` trials in all, each reserving `--ray-cpus`), `--rounds` steps
each.

For each step it prints:

- wall time against the floor: the trials' own agent + verifier seconds summed, over the slots
  the cluster gave (Slurm: the most elements running at once times `--concurrency`; Ray:
  `--ray-concurrency`, at most the cluster's CPUs over `--ray-cpus`);
- the tail: the slowest trial against the median one (Harbor's started_at..finished_at);
- each phase's share of the step's slot-seconds (wall x slots): before the first trial's
  element or worker started (checks, sbatch, the first wait in the queue), queueing (slots
  without an element while the step ran), our bookkeeping (an element's or worker's time
  around its trials: job launch, imports, markers, an element's end), container start (Harbor's
  environment_setup), agent (agent_setup + agent_execution), verifier, Harbor's rest of a trial
  (its own setup, the environment's stop, result files) and the end (last trial's end until
  the call returned: our look at the run, the lines);
- what a deadline at 1.2x the median step (over the rounds) would drop: groups (a task's
  attempts) with an attempt that ended after it;
- the machine's busy core-seconds per trial: /proc/stat's busy time over the step (the other
  users of this shared machine included; its rate in the 5 s before the step is shown), and
  this process's own CPU (the trainer's side of the call) per trial;
- what the step cost slurmctld, from `sdiag` before and after (its "by user" and "by message
  type" sections; types count every user, so other users' work while the step ran shows
  there, and "Jobs submitted" says whether anyone else submitted meanwhile): RPCs in all and
  per minute, by user and by type. The one sdiag call between the two snapshots is counted.

Each element's start and end come from `scontrol show job` after the step (Slurm keeps a
finished job for MinJobAge, 300 s here), after the second sdiag. Every trial must score 1, or
the figures mean nothing.

The three nodes are namespaces of one 2-core machine (6 Slurm CPUs over 2 real cores): the
figures are of our overhead per trial and per element and of slurmctld's load, not of speed.

Measured 2026-11-29, as hpcuser, 16 tasks x 4 attempts of a one-second task, four steps of
each executor, the machine shared with other users' tests (0.8-2 cores busy before a step):

- Slurm (`--concurrency 2`: 8 elements, 3 at once, 6 slots): wall 51-75 s against a floor of
  12-13 s (4.2-5.7x), 51-76 trials/min; tail 1.2-1.8x; shares: before the first start 0-1 %,
  queueing 8-14 %, our bookkeeping 46-58 % (an element's start to its first trial 1.4-2.4 s,
  its last trial's end to its end 1.3-3.8 s), container start 7-10 %, agent 16-22 %, verifier
  1-2 %, Harbor's rest 4-6 %, the end 0-3 %; 0 of 16 groups dropped at 1.2x the median step;
  CPU 0.83-0.89 s per trial in the jobs (0.34-0.37 s since workers import litellm only for an
  agent that did: two steps after, one before at 0.77 s), 0.06 s in this process; slurmctld
  50-58 RPCs a step (0.8-0.9 per trial, 42-66/min): 8 each of JOB_STEP_CREATE,
  HET_JOB_ALLOC_INFO, STEP_COMPLETE, COMPLETE_BATCH_SCRIPT (4 per element), PARTITION_INFO 5-7,
  JOB_INFO_SINGLE and FED_INFO 4-5 (a squeue every 15 s), NODE_INFO 1-3, PING 1-2, BUILD_INFO 1,
  SUBMIT_BATCH_JOB 1, slurmd's NODE_REGISTRATION_STATUS 3 and EPILOG_COMPLETE 1-2.
- Ray (`--ray-concurrency 6 --ray-cpus 1`, one Ray node a Slurm node): wall 41-67 s against
  14-17 s (2.8-4.5x), 58-93 trials/min; tail 3.7-8x (the first wave's containers start in
  10-13 s: new drivers and hosts each step); shares: before the first start 2-7 %, queueing 0,
  our bookkeeping 11-20 %, container start 35-46 %, agent 19-30 %, verifier 3-6 %, Harbor's
  rest 7-12 %, the end 0-4 %; 0 of 16 groups dropped; CPU at least 0.04-0.20 s per trial in the
  Ray job and 0.22-0.23 s in this process's tree; slurmctld: none of ours (3 registrations a
  minute from the slurmds).

Usage (as an ordinary user, /var/lib/harbor-hpc-ci/env.sh sourced):
    uv run --frozen --extra ray python bench/bench_step.py [--tasks 16] [--attempts 4]
        [--rounds 2] [--executors slurm,ray] [--concurrency 2] [--ray-concurrency 6]
        [--ray-cpus 1] [--solve-sleep 1] [--sif SIF]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from bench_ray_fleet import ray_cluster

from harbor_hpc.api import RolloutRequest, run_rollouts
from harbor_hpc.results.outcomes import RunTrials
from harbor_hpc.results.record import load_run
from tests.support.images import build_debian_sif
from tests.support.multinode import multinode_work
from tests.support.sample_tasks import make_task

DEADLINE_FACTOR = 1.2
CLUSTER_CPUS = 6  # the three-node cluster: 3 nodes x 2 CPUs (slurm-multi.conf)
PHASES = (
    "before the first start",
    "queueing",
    "our bookkeeping",
    "container start",
    "agent",
    "verifier",
    "Harbor's rest",
    "the end",
)


# --- the machine and slurmctld, before and after ---


def busy_seconds() -> float:
    """Busy core-seconds of this machine since boot (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds of processes `pids` (a whole tree of them) and of the children they reaped:
    a tree's total, however many of its processes have ended, so long as its root lives."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return total / CLOCK_TICKS


class CpuSampler(threading.Thread):
    """CPU seconds of each Slurm job of ours on the three nodes (every process in its memory
    cgroup, read from /proc; Slurm gathers no CPU accounting here) and of this process's tree,
    each the most seen, looked at every 0.25 s; `now`, the last look (a Ray cluster's job lives
    across steps, and its total drops when a process whose reaper is outside it ends). A lower
    bound: a process that ends after the last look before its job's end is not counted, nor
    one whose reaper is outside the tree."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.jobs: dict[str, float] = {}
        self.now: dict[str, float] = {}
        self.own = 0.0
        self.stopping = threading.Event()

    def run(self) -> None:
        me = psutil.Process()
        while not self.stopping.wait(0.25):
            for job in Path("/sys/fs/cgroup/memory").glob(f"slurm_n*/uid_{os.getuid()}/job_*"):
                pids: list[int] = []
                for procs in job.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError, ValueError):
                        pids += [int(pid) for pid in procs.read_text().split()]
                name = job.name.removeprefix("job_")
                self.now[name] = tree_cpu(pids)
                self.jobs[name] = max(self.jobs.get(name, 0.0), self.now[name])
            with contextlib.suppress(psutil.Error):
                pids = [me.pid] + [child.pid for child in me.children(recursive=True)]
                self.own = max(self.own, tree_cpu(pids))


@dataclass
class Rpcs:
    by_type: dict[str, int] = field(default_factory=dict)
    by_user: dict[str, int] = field(default_factory=dict)
    jobs_submitted: int = 0

    def __sub__(self, before: Rpcs) -> Rpcs:
        def less(after: dict[str, int], earlier: dict[str, int]) -> dict[str, int]:
            counts = {name: n - earlier.get(name, 0) for name, n in after.items()}
            return {name: n for name, n in counts.items() if n}

        return Rpcs(
            less(self.by_type, before.by_type),
            less(self.by_user, before.by_user),
            self.jobs_submitted - before.jobs_submitted,
        )


RPC_LINE = re.compile(r"^\s+(\S+)\s+\(\s*\d+\)\s+count:(\d+)")


def sdiag() -> Rpcs:
    """slurmctld's RPC counts so far (sdiag: any user may ask)."""
    text = subprocess.run(["sdiag"], check=True, capture_output=True, text=True).stdout
    rpcs, section = Rpcs(), None
    for line in text.splitlines():
        if line.startswith("Remote Procedure Call statistics by message type"):
            section = rpcs.by_type
        elif line.startswith("Remote Procedure Call statistics by user"):
            section = rpcs.by_user
        elif not line.startswith((" ", "\t")):
            section = None
            if line.startswith("Jobs submitted:"):
                rpcs.jobs_submitted = int(line.split(":")[1])
        elif section is not None and (match := RPC_LINE.match(line)):
            section[match[1]] = int(match[2])
    return rpcs


# --- one step ---


def when(text: str | None) -> float:
    """Epoch seconds of an ISO time (Harbor's and ours: aware; Slurm's: local), NaN for none."""
    if not text or text in ("Unknown", "None"):
        return float("nan")
    moment = datetime.fromisoformat(text)
    return (moment if moment.tzinfo else moment.astimezone()).timestamp()


def span(timing: dict[str, Any] | None) -> float:
    if not timing:
        return 0.0
    return max(0.0, when(timing.get("finished_at")) - when(timing.get("started_at")))


@dataclass
class Trial:
    group: str
    element: str | None  # the Slurm element (1234_5), None on Ray
    worker_start: float  # our marker: the worker began this unit
    start: float  # Harbor's started_at
    end: float  # Harbor's finished_at
    setup: float  # container start: environment_setup
    agent: float  # agent_setup + agent_execution
    verifier: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED")


def elements(job_ids: list[str]) -> dict[str, tuple[float, float, str, str]]:
    """Each array element's start, end, state and own job id (`scontrol show job`: one
    REQUEST_JOB_INFO_SINGLE and one REQUEST_FED_INFO per array; Slurm keeps a finished job for
    MinJobAge)."""
    found: dict[str, tuple[float, float, str, str]] = {}
    for job in job_ids:
        command = ["scontrol", "-o", "show", "job", job]
        ran = subprocess.run(command, capture_output=True, text=True, check=False)
        for line in ran.stdout.splitlines():
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            name = f"{fields.get('ArrayJobId', fields['JobId'])}_{fields.get('ArrayTaskId', '0')}"
            state = fields.get("JobState", "")
            start, end = when(fields.get("StartTime")), when(fields.get("EndTime"))
            found[name] = (start, end, state, fields["JobId"])
    return found


def when_ended(job_ids: list[str]) -> tuple[dict[str, tuple[float, float, str, str]], int]:
    """The elements once none is live any more (asked every 2 s), and how many times asked."""
    asked = 0
    while True:
        found = elements(job_ids)
        asked += 1
        if not any(state in LIVE for _, _, state, _ in found.values()):
            return found, asked
        time.sleep(2)


@dataclass
class Step:
    executor: str
    wall: float
    began: float  # epoch seconds of the call
    trials: list[Trial]
    slots: int
    held: list[tuple[float, float, int]]  # (start, end, slots) of each element (Slurm)
    names: dict[str, tuple[float, float, int]]  # the same by element (1234_5)
    busy: float  # core-seconds of the machine
    busy_rate_before: float  # core-seconds a second in the 5 s before
    own: float  # CPU seconds of this process's tree (the trainer's side, workers included)
    jobs_cpu: float  # CPU seconds of the step's Slurm jobs (Ray: the cluster's job)
    rpcs: Rpcs  # from the call until it returned
    rpcs_jobs: Rpcs  # from the call until its jobs had left the nodes (the bench's own less)
    after_return: float  # s the last element ran on after the call returned

    @property
    def floor(self) -> float:
        return sum(t.agent + t.verifier for t in self.trials) / self.slots

    @property
    def shares(self) -> dict[str, float]:
        """Slot-seconds of each phase (they sum to wall x slots)."""
        first = min(t.worker_start for t in self.trials) - self.began
        last = max(t.end for t in self.trials) - self.began
        if self.held:
            first = min(first, min(start for start, _, _ in self.held) - self.began)
            held = sum(
                (min(end, self.began + last) - max(start, self.began + first)) * slots
                for start, end, slots in self.held
            )
        else:  # Ray: the workers hold their slots from the first start to the last end
            held = (last - first) * self.slots
        in_trials = sum(t.seconds for t in self.trials)
        phases = {
            "before the first start": first * self.slots,
            "queueing": (last - first) * self.slots - held,
            "our bookkeeping": held - in_trials,
            "container start": sum(t.setup for t in self.trials),
            "agent": sum(t.agent for t in self.trials),
            "verifier": sum(t.verifier for t in self.trials),
            "Harbor's rest": sum(t.seconds - t.setup - t.agent - t.verifier for t in self.trials),
            "the end": (self.wall - last) * self.slots,
        }
        return phases

    def bookkeeping(self) -> dict[str, float]:
        """Medians of our own parts (s): an element's start until its worker began the first
        trial (job launch, Python, imports), the worker's start of a trial until Harbor's, and
        an element's last trial's end until the element ended."""
        by_element: dict[str | None, list[Trial]] = {}
        for trial in self.trials:
            by_element.setdefault(trial.element, []).append(trial)
        parts = {"worker to Harbor's start": [t.start - t.worker_start for t in self.trials]}
        if self.held:
            starts = {name: (start, end) for name, (start, end, _) in self.names.items()}
            launch, teardown = [], []
            for element, trials in by_element.items():
                start, end = starts[element if element and "_" in element else f"{element}_0"]
                launch.append(min(t.worker_start for t in trials) - start)
                teardown.append(end - max(t.end for t in trials))
            parts["element start to its worker's first trial"] = launch
            parts["element's last trial end to its end"] = teardown
        else:
            parts["call to the first trial"] = [
                min(t.worker_start for t in self.trials) - self.began
            ]
        return {name: statistics.median(values) for name, values in parts.items()}

    def dropped(self, deadline: float) -> int:
        """Groups with an attempt that ended after `deadline` s from the call."""
        late = {t.group for t in self.trials if t.end - self.began > deadline}
        return len(late)


def read_trials(run_dir: Path, lines: list[dict[str, Any]]) -> list[Trial]:
    markers = {marker.trial: marker for marker in RunTrials(run_dir, reward_key=None).markers}
    trials = []
    for line in lines:
        trial_dir = Path(line["trial_dir"])
        result = json.loads((trial_dir / "result.json").read_text())
        marker = markers[trial_dir.name]
        trials.append(
            Trial(
                group=str(line["group"]),
                element=marker.job,
                worker_start=when(marker.started_at),
                start=when(result["started_at"]),
                end=when(result["finished_at"]),
                setup=span(result.get("environment_setup")),
                agent=span(result.get("agent_setup")) + span(result.get("agent_execution")),
                verifier=span(result.get("verifier")),
            )
        )
    return trials


def one_step(
    request: RolloutRequest,
    slots: int,
    executor: str,
    concurrency: int,
    sampler: CpuSampler,
    ray_jobs: list[str],
) -> tuple[Step, list[float]]:
    """Run `request` as a step, with the machine's and slurmctld's counts around it."""
    before_busy = busy_seconds()
    time.sleep(5)
    rate = (busy_seconds() - before_busy) / 5
    rpcs_before = sdiag()
    time.sleep(0.5)  # the sampler's look before the step
    jobs_before, own = dict(sampler.now), sampler.own
    busy, began_at = busy_seconds(), time.time()
    began = time.perf_counter()
    lines = run_rollouts(request)
    wall = time.perf_counter() - began
    busy = busy_seconds() - busy
    returned = sdiag()
    rewards = [line["reward"] for line in lines]
    expected = request.attempts * len(list(Path(request.tasks).iterdir()))
    if rewards != [1.0] * expected:
        sys.exit(f"{executor}: not every trial solved its task ({rewards}): no figures")
    trials = read_trials(Path(request.run_dir), lines)
    held: list[tuple[float, float, int]] = []
    names: dict[str, tuple[float, float, int]] = {}
    after_return, asked = 0.0, 0
    if executor == "slurm":
        record = load_run(Path(request.run_dir))
        job_ids = [job for sub in record.submissions for job in sub.job_ids]
        found, asked = when_ended(job_ids)
        # Slurm's times are whole seconds: an element's start is never before the call.
        names = {
            name: (max(start, began_at), end, concurrency)
            for name, (start, end, _, _) in found.items()
        }
        ray_jobs = [job for _, _, _, job in found.values()]
        held = list(names.values())
        slots = concurrency * most_at_once([(start, end) for start, end, _ in held]) or slots
        after_return = max(end for _, end, _ in held) - (began_at + wall)
    time.sleep(0.5)  # the sampler's last look
    # The step's elements: the most seen; a Ray cluster's job: its last look less the first.
    seen = sampler.jobs if executor == "slurm" else sampler.now
    jobs_cpu = sum(seen.get(job, 0.0) - jobs_before.get(job, 0.0) for job in ray_jobs)
    own = sampler.own - own
    ended = sdiag()
    ours = Rpcs(
        {"REQUEST_JOB_INFO_SINGLE": asked, "REQUEST_FED_INFO": asked, "REQUEST_STATS_INFO": 2},
        {os.environ.get("USER", "?"): 2 * asked + 2},
    )
    mine = Rpcs({"REQUEST_STATS_INFO": 1}, {os.environ.get("USER", "?"): 1})
    step = Step(
        executor, wall, began_at, trials, slots, held, names, busy, rate, own, jobs_cpu,
        returned - rpcs_before - mine, ended - rpcs_before - ours, after_return,
    )  # fmt: skip
    return step, rewards


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, change in events:
        now += change
        most = max(most, now)
    return most


# --- the report ---


def report(step: Step, deadline: float, trials_per_step: int) -> None:
    seconds = sorted(t.seconds for t in step.trials)
    median = statistics.median(seconds)
    total = step.wall * step.slots
    minutes = step.wall / 60
    print(f"\n{step.executor}: {trials_per_step} trials, {step.slots} slots")
    rate = trials_per_step / minutes
    print(f"  wall {step.wall:.1f} s against the floor {step.floor:.1f} s ", end="")
    print(f"({step.wall / step.floor:.1f}x); {rate:.0f} trials/min")
    print(f"  tail: slowest trial {seconds[-1]:.1f} s, median {median:.1f} s "
          f"({seconds[-1] / median:.1f}x)")  # fmt: skip
    print("  phases (share of wall x slots; seconds per trial):")
    for name, value in step.shares.items():
        print(f"    {name:24} {value / total:6.1%} {value / trials_per_step:6.2f} s")
    print("  our bookkeeping, medians: " + "; ".join(
        f"{name} {value:.1f} s" for name, value in step.bookkeeping().items()))  # fmt: skip
    groups = len({t.group for t in step.trials})
    print(f"  deadline {deadline:.1f} s ({DEADLINE_FACTOR}x the median step): ", end="")
    print(f"{step.dropped(deadline)} of {groups} groups dropped")
    others = step.busy_rate_before * step.wall
    print(f"  CPU per trial: the step's jobs {step.jobs_cpu / trials_per_step:.2f} s, this "
          f"process's tree {step.own / trials_per_step:.2f} s, in all "
          f"{(step.jobs_cpu + step.own) / trials_per_step:.2f} s; the machine's busy time "
          f"{step.busy / trials_per_step:.2f} core-s per trial")  # fmt: skip
    print(f"    ({(step.busy - others) / trials_per_step:.2f} over the machine's "
          f"{step.busy_rate_before:.2f} busy cores in the 5 s before: other users')")  # fmt: skip
    if step.held:
        print(f"  its elements ran on {step.after_return:.1f} s after the call returned")
    for name, rpcs in (
        ("until the call returned", step.rpcs),
        ("until its jobs ended", step.rpcs_jobs),
    ):
        total_rpcs = sum(rpcs.by_type.values())
        users = ", ".join(f"{user} {n} ({n / minutes:.0f}/min)" for user, n in rpcs.by_user.items())
        print(f"  slurmctld RPCs {name}: {total_rpcs} ({total_rpcs / minutes:.0f}/min of the "
              f"step's wall), {total_rpcs / trials_per_step:.2f} per trial; by user: {users}; "
              f"jobs submitted meanwhile {rpcs.jobs_submitted}")  # fmt: skip
    for name, n in sorted(step.rpcs_jobs.by_type.items(), key=lambda item: -item[1]):
        print(f"    {name:36} {n:6} {n / minutes:7.1f}/min")


# --- main ---


def make_tasks(root: Path, count: int, sif: Path, sleep: float) -> Path:
    for number in range(count):
        task = make_task(root, f"t{number:03d}", image=str(sif))
        (task / "solution" / "solve.sh").write_text(
            f"#!/bin/bash\nsleep {sleep}\necho 42 > /tmp/answer\n"
        )
    return root


@contextlib.contextmanager
def executor_cluster(
    executor: str, args: argparse.Namespace, work: Path
) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """The request's fields for `executor` and the Slurm jobs of its Ray cluster, up while the
    block runs."""
    if executor == "slurm":
        yield (
            {"executor": "slurm", "concurrency": args.concurrency, "partition": args.partition},
            [],
        )
        return
    with ray_cluster(args, parent=work) as cluster_dir:
        job = json.loads((cluster_dir / "cluster.json").read_text())["job_id"]
        fields = {
            "executor": "ray",
            "concurrency": args.ray_concurrency,
            "environment_kwargs": {"ray_cluster_dir": cluster_dir, "ray_cpus": args.ray_cpus},
        }
        yield fields, [str(job)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="steps of each executor")
    parser.add_argument("--executors", default="slurm,ray")
    parser.add_argument("--concurrency", type=int, default=2, help="trials an element runs")
    parser.add_argument("--ray-concurrency", type=int, default=6, help="trials at once on Ray")
    parser.add_argument("--ray-cpus", type=float, default=1.0)
    parser.add_argument("--solve-sleep", type=float, default=1.0)
    parser.add_argument("--partition", default="multi")
    parser.add_argument("--sif", type=Path, default=None, help="default: built from Docker")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    # The Ray cluster (bench_ray_fleet.ray_cluster): one Ray node on each of the three nodes.
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--ray-nodes-per-node", type=int, default=1)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--ray-minutes", type=int, default=30)
    args = parser.parse_args(argv)
    env, work = multinode_work("bench-step-")
    sampler = CpuSampler()
    sampler.start()
    os.environ.update(SLURM_CONF=env["SLURM_CONF"])  # sbatch, squeue and sdiag: the 3 nodes
    try:
        sif = args.sif or build_debian_sif(work / "debian.sif", os.environ, background=False)
        tasks = make_tasks(work / "tasks", args.tasks, sif, args.solve_sleep)
        count = args.tasks * args.attempts
        print(f"{args.tasks} tasks x {args.attempts} attempts on {sif}; work in {work}", flush=True)
        steps: dict[str, list[Step]] = {}
        for executor in args.executors.split(","):
            with executor_cluster(executor, args, work) as (fields, ray_jobs):
                slots = min(args.ray_concurrency, int(CLUSTER_CPUS / args.ray_cpus))
                for number in range(args.rounds):
                    request = RolloutRequest(
                        tasks=tasks,
                        run_dir=work / f"{executor}-{number}",
                        agent="oracle",
                        attempts=args.attempts,
                        **fields,
                    )
                    step, _ = one_step(
                        request, slots, executor, args.concurrency, sampler, ray_jobs
                    )
                    steps.setdefault(executor, []).append(step)
                    print(f"  {executor} step {number}: {step.wall:.1f} s", flush=True)
        for done in steps.values():
            deadline = DEADLINE_FACTOR * statistics.median(step.wall for step in done)
            for step in done:
                report(step, deadline, count)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
