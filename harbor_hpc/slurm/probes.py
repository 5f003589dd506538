"""Whether Slurm works here, for this user: the Slurm part of `harbor-hpc doctor`.

The commands on PATH, a controller that answers, and a partition with a node that can run jobs,
asked through the same calls submit and status make (cluster.py).
"""

from __future__ import annotations

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
