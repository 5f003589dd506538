"""Speed of the prep steps on a dataset shaped like the one users name: 10,000 tasks, few images.

Makes the tasks in a temporary folder (or --root), then times, through the same module code the
CLI runs:
  plan     discover + hash every build context (what `build --dry-run` does)  goal < 10 s
  rewrite  set docker_image in every task.toml from a manifest               goal < 15 s
  rerun    the same rewrite again (nothing left to change)

Usage: uv run python bench/bench_prep.py [--tasks 10000] [--contexts 9] [--root DIR]
"""

from __future__ import annotations

import argparse
import hashlib
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
tags = ["synthetic", "bench"]

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
RUN echo {domain} > /etc/domain
"""


def make_tasks(root: Path, tasks: int, contexts: int) -> None:
    for index in range(tasks):
        domain = f"domain{index % contexts}"
        task = root / domain / f"task-{index:05d}"
        (task / "environment" / "files").mkdir(parents=True)
        (task / "solution").mkdir()
        (task / "tests").mkdir()
        (task / "task.toml").write_text(TASK_TOML.format(domain=domain))
        (task / "instruction.md").write_text(f"Solve task {index}.\n")
        (task / "environment" / "Dockerfile").write_text(DOCKERFILE.format(domain=domain))
        (task / "environment" / "files" / "data.csv").write_text(f"{domain}\n" * 2000)
        (task / "environment" / "files" / "helper.py").write_text("print('help')\n")
        (task / "environment" / ".dockerignore").write_text("*.pyc\n")
        (task / "solution" / "solve.sh").write_text("#!/bin/bash\necho done\n")
        (task / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")


def timed[T](label: str, goal: float | None, action: Callable[[], T]) -> T:
    start = time.perf_counter()
    result = action()
    elapsed = time.perf_counter() - start
    verdict = ""
    if goal is not None:
        verdict = "  ok" if elapsed < goal else f"  OVER the {goal:.0f} s goal"
    print(f"{label:<10} {elapsed:7.2f} s{verdict}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--contexts", type=int, default=9)
    parser.add_argument("--root", type=Path, help="where to make the tasks [default: a tmp dir]")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-prep-", dir=args.root))
    try:
        root = base / "tasks"
        timed("make", None, lambda: make_tasks(root, args.tasks, args.contexts))
        plan = timed("plan", 10.0, lambda: plan_build(root, "registry.example.org/bench"))
        print(f"           {plan.task_count} tasks, {len(plan.images)} distinct contexts")
        manifest = Manifest(str(plan.registry), str(plan.root))
        for key, image in plan.images.items():
            digest = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
            manifest.set_image(key, ImageRecord(image.repository, image.tag, image.tasks, digest))
        manifest_path = base / "manifest.json"
        save_manifest(manifest_path, manifest)
        result = timed("rewrite", 15.0, lambda: rewrite_tasks(root, manifest_path))
        print(f"           changed {len(result.changed)} task.toml files")
        timed("rerun", None, lambda: rewrite_tasks(root, manifest_path))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
