"""Speed of the prep steps on a dataset shaped like the one users name: 10,000 tasks, few images.

Makes the tasks in a temporary folder (or --root), then times each step from a flushed disk,
through the same module code the CLI runs (goals for 10,000 tasks on an idle machine, scaled
linearly for other sizes):
  floor    read and SHA-256 every file of the tasks: the least any step that reads them costs
  plan     discover + hash every build context (what `build --dry-run` does)  goal 1.5 s
  rewrite  set docker_image in every task.toml from a manifest               goal 3 s
  rerun    the same rewrite again (nothing left to change)                    goal 1 s
Each step is printed with its goal and its ratio to the floor measured in the same run, so runs
on machines of other speeds (and at 100,000 tasks: `--tasks 100000`) compare.

With --distinct every task.toml and Dockerfile is its task's own (one context per task), so no
step gains from equal files, as in datasets whose tasks each have their own image.

Usage: uv run python bench/bench_prep.py [--tasks 10000] [--contexts 9] [--distinct] [--root DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harbor_hpc.images.build import plan_build
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, save_manifest
from harbor_hpc.tasks.rewrite import rewrite_tasks

TASK_TOML = """\
version = "1.0"

[metadata]
author_name = "bench"
difficulty = "medium"
category = "{domain}"
tags = ["synthetic", "bench", "{label}"]

[verifier]
timeout_sec = 900.0

[agent]
timeout_sec = 1800.0

[environment]
# the image every trial of this task starts from
build_timeout_sec = 600.0
cpus = 1
memory_mb = 2048
storage_mb = 10240
"""

DOCKERFILE = """\
FROM local/debian:bookworm
WORKDIR /app
COPY files/ /app/
RUN echo {label} > /etc/domain
"""


# Seconds each step may take for 10,000 tasks (issue 28); linear in the number of tasks.
GOALS = {"plan": 1.5, "rewrite": 3.0, "rerun": 1.0}


def make_tasks(root: Path, tasks: int, contexts: int, distinct: bool) -> None:
    for index in range(tasks):
        domain = f"domain{index % contexts}"
        label = f"task{index}" if distinct else domain
        task = root / domain / f"task-{index:05d}"
        (task / "environment" / "files").mkdir(parents=True)
        (task / "solution").mkdir()
        (task / "tests").mkdir()
        (task / "task.toml").write_text(TASK_TOML.format(domain=domain, label=label))
        (task / "instruction.md").write_text(f"Solve task {index}.\n")
        (task / "environment" / "Dockerfile").write_text(DOCKERFILE.format(label=label))
        (task / "environment" / "files" / "data.csv").write_text(f"{domain}\n" * 2000)
        (task / "environment" / "files" / "helper.py").write_text("print('help')\n")
        (task / "environment" / ".dockerignore").write_text("*.pyc\n")
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho done\n")
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")


def floor(root: Path) -> int:
    """Read and hash every file under `root`, as plainly as Python can; the number of files."""
    count = 0
    for folder, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as handle:
                hashlib.file_digest(handle, "sha256")
            count += 1
    return count


def timed[T](action: Callable[[], T]) -> tuple[T, float]:
    """`action`'s result and seconds, from a disk with nothing waiting to be written, as after
    the minutes between a fetch, a build and a rewrite: a step that flushes to disk would
    otherwise also write what the steps before it wrote (the tasks made, access times)."""
    os.sync()
    start = time.perf_counter()
    result = action()
    return result, time.perf_counter() - start


def report(label: str, elapsed: float, goal: float | None, base: float | None) -> None:
    """One step's time, its goal (None: none) and its ratio to the floor (None: it is the floor)."""
    line = f"{label:<8} {elapsed:7.2f} s"
    if base is not None:
        line += f"  {elapsed / base:5.1f}x floor"
    if goal is not None:
        line += f"  goal {goal:5.2f} s " + ("ok" if elapsed <= goal else "OVER")
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--contexts", type=int, default=9)
    parser.add_argument("--distinct", action="store_true", help="no two tasks' files alike")
    parser.add_argument("--root", type=Path, help="where to make the tasks [default: a tmp dir]")
    args = parser.parse_args()
    scale = args.tasks / 10_000
    base = Path(tempfile.mkdtemp(prefix="bench-prep-", dir=args.root))
    try:
        root = base / "tasks"
        _, elapsed = timed(lambda: make_tasks(root, args.tasks, args.contexts, args.distinct))
        report("make", elapsed, None, None)
        files, least = timed(lambda: floor(root))
        report("floor", least, None, None)
        print(f"         {files} files read and hashed")
        plan, elapsed = timed(lambda: plan_build(root, "registry.example.org/bench"))
        report("plan", elapsed, GOALS["plan"] * scale, least)
        print(f"         {plan.task_count} tasks, {len(plan.images)} distinct contexts")
        manifest = Manifest(str(plan.registry), str(plan.root))
        for key, image in plan.images.items():
            digest = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
            manifest.set_image(key, ImageRecord(image.repository, image.tag, image.tasks, digest))
        manifest_path = base / "manifest.json"
        save_manifest(manifest_path, manifest)
        result, elapsed = timed(lambda: rewrite_tasks(root, manifest_path))
        report("rewrite", elapsed, GOALS["rewrite"] * scale, least)
        print(f"         changed {len(result.changed)} task.toml files")
        _, elapsed = timed(lambda: rewrite_tasks(root, manifest_path))
        report("rerun", elapsed, GOALS["rerun"] * scale, least)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
