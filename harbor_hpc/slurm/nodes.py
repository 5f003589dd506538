"""Ask every node of a partition whether its Apptainer reads a zstd .sif (`doctor --nodes`).

One small job per node (slurm/ask_node.sh, held to its node by --nodelist) runs the node's
Apptainer, as our jobs would find it after the site's setup lines, on a tiny zstd image in the
store (a node without Apptainer, enroot's, lists it with the unsquashfs that unpacks our roots
there and mounts it with the squashfuse_ll that mounts them on an image's first use); what
each printed is its answer (runtimes/apptainer_nodes.py), kept for the compression of every
.sif made after. A node that is down, drained or still queued when the asking ends did
not answer: while one has not, images stay gzip.
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from harbor_hpc.containers.sif import root_partition
from harbor_hpc.core.cluster_name import slurm_cluster_name
from harbor_hpc.runtimes.apptainer_nodes import READ_MARK, Asked, parse_answer
from harbor_hpc.slurm import cluster
from harbor_hpc.slurm.cluster import SlurmPlacement

POLL_S = 1.0
_HINT = "the partition, account and qos are harbor-hpc.toml's (or --partition)"


def ask_nodes(
    placement: SlurmPlacement,
    image: Path,
    folder: Path,
    *,
    timeout: float,
    say: Callable[[str], None] = lambda _line: None,
) -> Asked:
    """Ask each node of `placement`'s partition (else the default one) to run `image` (a zstd
    .sif every node reaches); wait up to `timeout` s for the answers in `folder` (which every
    node reaches too), cancel the jobs still queued then."""
    cluster.require_sbatch("asking the nodes", hint="run on a Slurm login node")
    partition = root_partition(image)
    nodes = cluster.partition_nodes(placement.partition)
    where = replace(placement, partition=nodes.partition)
    folder.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="ask-", dir=folder))
    jobs: dict[str, str] = {}
    still: set[str] = set()  # the jobs queued and not yet ended
    try:
        for node in nodes.asked:
            script = logs / f"{node}.sh"
            script.write_text(
                where.render(
                    "ask_node.sh",
                    {
                        "node": node,
                        "log": str(logs / f"{node}.out"),
                        "sbatch": "\n".join(where.script_lines()),
                        "image": shlex.quote(str(image)),
                        "offset": str(partition.offset if partition else 0),
                        "mark": shlex.quote(READ_MARK),
                    },
                )
            )
            job = cluster.submit_script(script, what=f"asking node {node}", hint=_HINT)
            jobs[job] = node
            still.add(job)
        asked = f"asked {len(jobs)} node(s) of {nodes.partition}, a job each"
        say(f"{asked}; waiting up to {timeout:.0f} s for their answers")
        deadline = time.monotonic() + timeout
        while still and time.monotonic() < deadline:
            time.sleep(POLL_S)
            still = cluster.queued_jobs(still)
    finally:
        if still:  # waited long enough, or told to stop: the rest do not answer
            cluster.cancel(*sorted(still))
    answers = []
    unanswered = list(nodes.not_taking_jobs)
    for job, node in jobs.items():
        out = logs / f"{node}.out"
        if job in still or not out.is_file():
            unanswered.append(node)
            continue
        answers.append(parse_answer(node, out.read_text(errors="replace")))
    shutil.rmtree(logs, ignore_errors=True)  # what each said is in its answer
    return Asked(
        slurm_cluster_name(), nodes.partition, time.time(), tuple(answers), tuple(unanswered)
    )
