"""A tarball task dataset, packed as nvidia/Nemotron-Terminal-Synthetic-Tasks is."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

REPO_ID = "org/terminal-tasks"

# Repository path of each archive -> the tasks it holds, under a folder named like the archive,
# as in nvidia/Nemotron-Terminal-Synthetic-Tasks.
ARCHIVES = {
    "skill_based/mixed/scientific_computing.tar.gz": ["fit-curve", "solve-ode"],
    "skill_based/mixed/data_science.tar.gz": ["clean-csv"],
    "skill_based/easy/security.tgz": ["find-secret"],
}


def task_files(task: str, flavour: str = "") -> dict[str, tuple[bytes, int]]:
    """The files of one Harbor task, path -> (content, mode)."""
    return {
        "task.toml": (b'version = "1.0"\n[agent]\ntimeout_sec = 600\n', 0o644),
        "instruction.md": (f"Do {task}{flavour}.\n".encode(), 0o644),
        "environment/Dockerfile": (b"FROM local/debian:bookworm\n", 0o644),
        "solution/solve.sh": (b"#!/bin/bash\necho solved\n", 0o755),
        "tests/test.sh": (b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n", 0o755),
    }


def write_task_archive(archive: Path, tasks: list[str], flavour: str = "") -> None:
    """A .tar.gz/.tgz holding `<stem>/<task>/...`, the way the real dataset packs its tasks."""
    stem = archive.name.removesuffix(".tar.gz").removesuffix(".tgz")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        for task in tasks:
            for rel, (content, mode) in task_files(task, flavour).items():
                info = tarfile.TarInfo(f"{stem}/{task}/{rel}")
                info.size = len(content)
                info.mode = mode
                tar.addfile(info, io.BytesIO(content))
