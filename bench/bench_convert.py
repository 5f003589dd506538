"""Speed of a fully cached `convert`: what a rerun over a big dataset's images costs.

Makes a store holding N checked images (stand-in files marked as checked, as a finished
conversion leaves them) and a manifest naming them, then times:
  plan      `plan_conversions`: which images are cached (in-process)
  first     `harbor-hpc convert` recording every .sif in the manifest          goal < 5 s
  rerun     the same again, nothing left to write                             goal < 5 s
Apptainer is replaced by `false` for the CLI runs: a cached run must not call it at all.

Usage: uv run python bench/bench_convert.py [--images 500]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harbor_hpc.containers.store import mark_checked, resolve_source, sif_path_for
from harbor_hpc.steps.convert import plan_conversions
from harbor_hpc.tasks.manifest import ImageRecord, Manifest, save_manifest


def make_store(root: Path, images: int) -> Path:
    store = root / "store"
    manifest = Manifest(registry="registry.example.org/bench", tasks_root=str(root))
    for number in range(images):
        digest = "sha256:" + hashlib.sha256(str(number).encode()).hexdigest()
        record = ImageRecord(
            repository=f"registry.example.org/bench/image-{number}",
            tag="ctx",
            tasks=[f"domain/task-{number}-{k}" for k in range(20)],
            digest=digest,
        )
        manifest.set_image(f"ctx-{number}", record)
        sif = sif_path_for(record.reference or "", store)
        sif.parent.mkdir(parents=True, exist_ok=True)
        sif.write_bytes(b"stand-in image")
        reference = record.reference or ""
        mark_checked(sif, resolve_source(reference, nohttps=False), reference)
    path = root / "manifest.json"
    save_manifest(path, manifest)
    return path


def timed_cli(manifest: Path, store: Path) -> float:
    env = {**os.environ, "HARBOR_HPC_APPTAINER": "false"}
    started = time.perf_counter()
    command = ["convert", "--manifest", str(manifest), "--cache-dir", str(store), "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *command],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"convert failed:\n{result.stderr}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as scratch:
        root = Path(scratch)
        manifest = make_store(root, args.images)
        store = root / "store"
        started = time.perf_counter()
        planned = plan_conversions(manifest, store)
        plan_s = time.perf_counter() - started
        assert all(c.state == "cached" for c in planned)
        first_s = timed_cli(manifest, store)
        rerun_s = timed_cli(manifest, store)
    print(f"images: {args.images} (all cached)")
    print(f"plan:   {plan_s:.3f} s ({plan_s / args.images * 1e3:.2f} ms per image)")
    print(f"first:  {first_s:.2f} s  (CLI, records every .sif in the manifest; goal < 5 s)")
    print(f"rerun:  {rerun_s:.2f} s  (CLI, nothing to write; goal < 5 s)")


if __name__ == "__main__":
    main()
