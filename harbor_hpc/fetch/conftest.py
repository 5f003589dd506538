"""A tarball task dataset served by a loopback fake hub, and a fresh Hugging Face cache per test."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harbor_hpc.fetch.fakehub import FakeHub
from harbor_hpc.fetch.hub import Hub

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


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for path, tasks in ARCHIVES.items():
        write_task_archive(root / path, tasks)
    (root / "README.md").write_text("# terminal tasks\n")
    return root


@pytest.fixture
def fake_hub(dataset: Path) -> Iterator[FakeHub]:
    with FakeHub(dataset, REPO_ID) as hub:
        yield hub


@pytest.fixture
def hf_cache(tmp_path: Path) -> Path:
    return tmp_path / "hf-home" / "hub"


@pytest.fixture
def hub(fake_hub: FakeHub, hf_cache: Path) -> Hub:
    """Where in-process fetches go: huggingface_hub reads HF_ENDPOINT/HF_HOME at import only."""
    return Hub(endpoint=fake_hub.url, cache_dir=hf_cache)
