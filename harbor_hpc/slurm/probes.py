"""Whether Slurm works here, for this user: the Slurm part of `harbor-hpc doctor`.

The commands on PATH, a controller that answers, a partition with a node that can run jobs,
how jobs' memory is held, and the limits on arrays and on this user's queued jobs, asked through
the same calls submit and status make (cluster.py).
"""

from __future__ import annotations

import getpass

from harbor_hpc.core.probe import Finding, Status
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import Partitions, Ping, SlurmError


def findings() -> list[Finding]:
    missing = cluster.missing_commands()
    if missing:
        return [
            Finding(
                "commands",
                Status.MISSING,
                f"{missing[0]} is not on PATH",
                "on a cluster: `module load slurm`; else install slurm-client "
                "(`apt-get install slurm-client`)",
            )
        ]
    checks = [Finding("commands", Status.OK, cluster.version() or "sbatch found")]
    ping = cluster.ping()
    if not ping.up:
        return [*checks, _controller_down(ping)]
    checks.append(Finding("controller", Status.OK, "; ".join(ping.controllers)))
    checks.append(partitions_check())
    try:
        checks.append(judge_memory(cluster.config()))
    except SlurmError as exc:
        checks.append(Finding("jobs' memory", Status.WARN, exc.message, exc.hint or ""))
    try:
        room = cluster.submit_room(getpass.getuser())
        checks.append(judge_limits(cluster.max_array_size(), room))
    except SlurmError as exc:
        checks.append(Finding("job limits", Status.WARN, exc.message, exc.hint or ""))
    return checks


def judge_memory(config: dict[str, str]) -> Finding:
    """Whether Slurm holds each job to its memory (task/cgroup with ConstrainRAMSpace), and
    what that means for a trial over its memory_mb."""
    held = "task/cgroup" in config.get("TaskPlugin", "") and (
        config.get("ConstrainRAMSpace", "").lower() == "yes"
    )
    tracked = config.get("ProctrackType", "unknown")
    if held:
        return Finding(
            "jobs' memory",
            Status.OK,
            f"held to their --mem (task/cgroup, ConstrainRAMSpace; {tracked}): each element asks "
            "for its trials' memory_mb and 1 GB for harbor-hpc, and the watchdog ends a task "
            "over its memory_mb first; a smaller --mem fails trials `memory`, naming it",
        )
    return Finding(
        "jobs' memory",
        Status.OK,
        f"not held to their --mem by Slurm (TaskPlugin {config.get('TaskPlugin', 'unknown')}, "
        f"{tracked}): the watchdog alone holds each task to its memory_mb",
    )


def judge_limits(max_array: int, room: int | None) -> Finding:
    """What the cluster's limits on arrays (MaxArraySize) and on this user's queued jobs
    (MaxSubmitJobs, GrpSubmitJobs: `room` more now, None where none is known) make of a run."""
    arrays = f"arrays of up to {max_array} elements (MaxArraySize)"
    if room is None:
        return Finding(
            "job limits",
            Status.OK,
            f"{arrays}; no limit on your queued jobs known (none set, or Slurm keeps it "
            "private): should sbatch refuse one, submit queues fewer and the rest in waves",
        )
    waves = (
        "a run of more elements is queued in waves as yours leave the queue, while "
        "`submit --wait`, `status` or a trainer's call follows it"
    )
    said = f"{arrays}; you may queue {room} more job(s) now, each array element one"
    if room == 0:
        return Finding(
            "job limits",
            Status.WARN,
            f"{said} (MaxSubmitJobs): nothing of a run goes out now; {waves}",
            "wait for your jobs to leave the queue (`squeue --me`), or `scancel` those you "
            "no longer need",
        )
    return Finding("job limits", Status.OK, f"{said} (MaxSubmitJobs): {waves}")


def _controller_down(ping: Ping) -> Finding:
    reason = "; ".join(ping.controllers) if ping.controllers else ping.why
    said = ping.output.lower()
    if "munge" in said or "authentication" in said:
        fix = "start munged (`systemctl start munge`, or `sudo -u munge munged`) on every node"
    else:
        fix = (
            "start the controller (`systemctl start slurmctld`, or `slurmctld`) and munged; "
            "check SLURM_CONF points at the cluster's slurm.conf"
        )
    return Finding("controller", Status.MISSING, f"not reachable: {reason}", fix)


def partitions_check() -> Finding:
    try:
        found = cluster.partitions()
    except SlurmError as exc:
        return Finding("partitions", Status.MISSING, exc.message, exc.hint or "")
    return judge_partitions(found)


def judge_partitions(partitions: Partitions) -> Finding:
    """Whether some partition has a node that can run jobs."""
    if not partitions.states:
        fix = "an admin adds a PartitionName= line to slurm.conf"
        return Finding("partitions", Status.MISSING, "no partition defined", fix)
    if not partitions.usable:
        return Finding(
            "partitions",
            Status.MISSING,
            f"no partition has a node that can run jobs: {partitions.summary}",
            "an admin starts slurmd on the nodes (`systemctl start slurmd`), then "
            "`scontrol update nodename=NODE state=resume`",
        )
    return Finding("partitions", Status.OK, partitions.summary)
