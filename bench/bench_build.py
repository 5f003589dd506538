"""Time per build context: `build --builder apptainer` (straight into the .sif store) beside
`build --builder docker` (build + push) followed by `convert` (pull + squash), in one run.

Each context is a task of its own, built alone (`--jobs 1`) by both paths, with a fresh nonce so
that nothing is cached from an earlier run. The base image is put into the registry (Docker) and
into the Apptainer store (`convert`'s way) before timing: both paths start from a base they
have. Columns: apptainer = the whole Apptainer build; docker = build + push; convert = pull and
squash of the pushed image; docker+convert = what a user without Apptainer builds pays.

Usage: uv run python bench/bench_build.py [--registry localhost:5000] [--base IMAGE]
       (defaults: HARBOR_HPC_TEST_REGISTRY, HARBOR_HPC_TEST_BASE_IMAGE; Docker, a plain-HTTP
       registry and Apptainer with fakeroot needed)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from harbor_hpc.containers.store import ensure_sif

CONTEXTS = {
    "copy+run": (
        "FROM {base}\nWORKDIR /app\nCOPY . /app/\nRUN python3 -m compileall -q /app "
        "&& echo {nonce} > /app/nonce\n",
        {f"src/mod{n}.py": f"VALUE = {n}\n" for n in range(50)},
    ),
    "apt-like": (
        "FROM {base}\nRUN mkdir -p /opt/data && for i in $(seq 1 2000); do "
        "echo {nonce} $i > /opt/data/f$i; done\nENV DATA=/opt/data\n",
        {},
    ),
    "multi-stage": (
        "FROM {base} AS build\nRUN mkdir /out && dd if=/dev/urandom of=/out/blob bs=1M count=20 "
        "2>/dev/null && echo {nonce} > /out/nonce\nFROM {base}\nCOPY --from=build /out /srv/\n",
        {},
    ),
    "user": (
        "FROM {base}\nRUN useradd -m agent\nUSER agent\nRUN echo {nonce} > /home/agent/nonce\n"
        "USER root\n",
        {},
    ),
}


def harbor_hpc(*args: str, env: dict[str, str]) -> float:
    """Run `harbor-hpc ARGS`; its wall time in seconds."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args], capture_output=True, text=True, env=env
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"harbor-hpc {' '.join(args[:2])} failed:\n{done.stderr[-2000:]}")
    return elapsed


def make_task(root: Path, name: str, dockerfile: str, files: dict[str, str]) -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "task.toml").write_text("[environment]\ncpus = 1\n")
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    for file, text in files.items():
        (task / "environment" / file).parent.mkdir(parents=True, exist_ok=True)
        (task / "environment" / file).write_text(text)
    return task


def push_base(local: str, registry: str) -> str:
    reference = f"{registry}/harbor-hpc-bench/base:bookworm"
    for command in (["docker", "tag", local, reference], ["docker", "push", reference]):
        subprocess.run(command, check=True, capture_output=True, timeout=600)
    return reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", default=os.environ.get("HARBOR_HPC_TEST_REGISTRY"))
    parser.add_argument(
        "--base", default=os.environ.get("HARBOR_HPC_TEST_BASE_IMAGE", "local/debian:bookworm")
    )
    args = parser.parse_args()
    if not args.registry:
        raise SystemExit("--registry (or HARBOR_HPC_TEST_REGISTRY) is needed")
    base = push_base(args.base, args.registry)
    nonce = uuid.uuid4().hex[:10]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="bench-build-") as scratch:
        root = Path(scratch)
        store, docker_store = root / "store", root / "docker-store"
        started = time.perf_counter()
        ensure_sif(base, store, nohttps=True)
        base_s = time.perf_counter() - started
        rows = []
        for name, (dockerfile, files) in CONTEXTS.items():
            text = dockerfile.format(base=base, nonce=nonce)
            slug = name.replace("+", "-")
            apptainer = make_task(root / "apptainer" / slug, "task", text, files)
            docker = make_task(root / "docker" / slug, "task", text, files)
            built_s = harbor_hpc(
                "build", str(apptainer.parent), "--builder", "apptainer", "--cache-dir",
                str(store), "--manifest", str(root / f"{slug}-a.json"), "--nohttps", "--jobs",
                "1", env=env,
            )  # fmt: skip
            manifest = str(root / f"{slug}-d.json")
            pushed_s = harbor_hpc(
                "build", str(docker.parent), "--builder", "docker", "--registry",
                f"{args.registry}/harbor-hpc-bench-{nonce}", "--manifest", manifest, "--jobs",
                "1", env=env,
            )  # fmt: skip
            converted_s = harbor_hpc(
                "convert", "--manifest", manifest, "--cache-dir", str(docker_store),
                "--nohttps", "--jobs", "1", env=env,
            )  # fmt: skip
            rows.append((name, built_s, pushed_s, converted_s))
    print(f"base image into the Apptainer store once (convert): {base_s:.1f} s")
    print(f"{'context':<12} {'apptainer':>10} {'docker':>8} {'convert':>8} {'docker+convert':>15}")
    for name, built_s, pushed_s, converted_s in rows:
        total = pushed_s + converted_s
        print(f"{name:<12} {built_s:>9.1f}s {pushed_s:>7.1f}s {converted_s:>7.1f}s {total:>14.1f}s")
    apptainer_sum = sum(row[1] for row in rows)
    docker_sum = sum(row[2] + row[3] for row in rows)
    print(f"{'total':<12} {apptainer_sum:>9.1f}s {'':>8} {'':>8} {docker_sum:>14.1f}s")


if __name__ == "__main__":
    main()
