"""What the compute nodes said they can read: the answers `harbor-hpc doctor --nodes` gathers.

A .sif made here runs on other nodes, whose Apptainer may be older than this one's (before 1.4
it calls a zstd image corrupted) or whose squashfuse lacks zstd. So the compression of every
.sif (`runtime.sif_compression`) follows what the nodes that will run it said: each node of a
partition runs a tiny zstd image in a job of its own (slurm/nodes.py) and its answer is kept
here, per user, in `~/.cache/harbor-hpc/nodes.json`, one entry per cluster and partition.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harbor_hpc.core.cluster_name import slurm_cluster_name
from harbor_hpc.core.config import default_cache_dir
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_write_json, file_lock, read_json

# What a node whose Apptainer ran the zstd probe image prints after it (slurm/ask_node.sh).
READ_MARK = "harbor-hpc: read the zstd image"


@dataclass(frozen=True)
class NodeAnswer:
    """One node's answer: its `apptainer --version`, and whether it ran a zstd image (else
    what it said)."""

    node: str
    apptainer: str
    reads_zstd: bool
    said: str = ""


@dataclass(frozen=True)
class Asked:
    """One asking of a partition's nodes: who answered what, and who did not answer (down,
    drained, or still queued when the asking ended)."""

    cluster: str
    partition: str
    when: float
    answers: tuple[NodeAnswer, ...]
    unanswered: tuple[str, ...] = ()

    @property
    def reads_zstd(self) -> bool:
        """Every node of the partition answered, and every one read the zstd image."""
        return (
            bool(self.answers) and not self.unanswered and all(a.reads_zstd for a in self.answers)
        )

    @property
    def key(self) -> str:
        return f"{self.cluster}/{self.partition}"

    def why_not_zstd(self) -> str:
        """Why not every node of the partition reads zstd ("" when every one does)."""
        for answer in self.answers:
            if not answer.reads_zstd:
                said = answer.said or "no answer"
                return (
                    f"node {answer.node} of {self.key} ({answer.apptainer or 'no apptainer'}) "
                    f"cannot read a zstd image: {said}"
                )
        if self.unanswered:
            names = ", ".join(self.unanswered[:5]) + (" ..." if len(self.unanswered) > 5 else "")
            return f"{_count(len(self.unanswered), 'node')} of {self.key} did not answer: {names}"
        return ""

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "partition": self.partition,
            "when": self.when,
            "reads_zstd": self.reads_zstd,
            "answers": [asdict(answer) for answer in self.answers],
            "unanswered": list(self.unanswered),
        }


def parse_answer(node: str, output: str) -> NodeAnswer:
    """A node's job output (slurm/ask_node.sh): `apptainer --version`'s line, then the mark, or
    Apptainer's complaint."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    version = next((line for line in lines if " version " in line), "")
    if READ_MARK in lines:
        return NodeAnswer(node, version, True)
    said = next((line for line in reversed(lines) if line != version), "")
    return NodeAnswer(node, version, False, said or "the job printed nothing")


def answers_file() -> Path:
    """The user's answers, beside the default .sif store (never in a store chosen per run)."""
    return default_cache_dir().parent / "nodes.json"


def load_answers() -> list[Asked]:
    """Every asking kept, newest per partition; none when the nodes were never asked (or the
    file is damaged: they are asked again)."""
    path = answers_file()
    if not path.is_file():
        return []
    try:
        data = read_json(path)
        return [_asked(entry) for entry in data.values()]
    except (HarborHpcError, AttributeError, KeyError, TypeError, ValueError):
        return []


def save_answers(asked: Asked) -> None:
    """Keep `asked` in place of the partition's earlier answers, the others as they were
    (several processes may save at once: one at a time, each file whole)."""
    path = answers_file()
    with file_lock(path.with_name(".nodes.lock")):
        kept = {entry.key: entry for entry in load_answers()}
        kept[asked.key] = asked
        atomic_write_json(path, {key: entry.to_json() for key, entry in sorted(kept.items())})


def _asked(entry: dict[str, Any]) -> Asked:
    return Asked(
        cluster=str(entry["cluster"]),
        partition=str(entry["partition"]),
        when=float(entry["when"]),
        answers=tuple(NodeAnswer(**answer) for answer in entry["answers"]),
        unanswered=tuple(str(node) for node in entry.get("unanswered", [])),
    )


def zstd_verdict() -> tuple[bool | None, str]:
    """Whether the nodes asked of the Slurm cluster this process talks to read zstd images:
    None when none of them were ever asked, else True or False with the reason. Another
    cluster's answers (a second SLURM_CONF, a shared home) are not this cluster's."""
    here = slurm_cluster_name()
    asked = [entry for entry in load_answers() if entry.cluster == here]
    if not asked:
        return None, (
            f"the compute nodes of {here} have not been asked whether they read zstd images "
            "(`harbor-hpc doctor --nodes` asks them)"
        )
    for entry in asked:
        if not entry.reads_zstd:
            return False, entry.why_not_zstd()
    nodes = sum(len(entry.answers) for entry in asked)
    partitions = ", ".join(entry.key for entry in asked)
    age = _age(time.time() - max(entry.when for entry in asked))
    return True, f"{_count(nodes, 'node')} of {partitions} read zstd images (asked {age})"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _age(seconds: float) -> str:
    """`5 min ago`, `3 h ago`, `2 days ago`."""
    if seconds < 3600:
        return f"{max(seconds // 60, 0):.0f} min ago"
    if seconds < 2 * 86400:
        return f"{seconds // 3600:.0f} h ago"
    return f"{seconds // 86400:.0f} days ago"
