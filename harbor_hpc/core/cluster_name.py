"""Which Slurm cluster this process talks to: its ClusterName, as `scontrol show config` says.

What we keep per user of a cluster is kept per cluster, where one home serves several (a login
node with two SLURM_CONFs, or clusters that share home folders): the nodes' answers about zstd
images (`runtimes/apptainer_nodes.py`) and the default folder of `ray up`'s cluster
(`ray/cluster.py`).
"""

from __future__ import annotations

import functools
import shutil

from harbor_hpc.core.proc import run

# Where no Slurm answers (a laptop, a node without scontrol): one name for all that is kept.
NO_SLURM = "local"


@functools.cache
def slurm_cluster_name() -> str:
    """The ClusterName of SLURM_CONF's cluster, NO_SLURM where no Slurm answers; asked once per
    process."""
    if shutil.which("scontrol") is None:
        return NO_SLURM
    ran = run(["scontrol", "show", "config"])
    for line in ran.stdout.splitlines() if ran.ok else []:
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName" and value.strip():
            return value.strip()
    return NO_SLURM
