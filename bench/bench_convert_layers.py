"""`convert` of a registry image where there is no Apptainer (issue 57), side by side in one run:
`enroot import docker://...` (what an enroot cluster's user runs: a .sqsh, every file root's; in
a user namespace, `unshare --map-root-user --map-auto`, because enroot's helpers need the file
capabilities its enroot+caps package sets, which an enroot built from source has not: without
them `enroot-aufs2ovlfs: failed to set capabilities`, and even in the namespace an image with an
opaque folder fails, `failed to create opaque ovlfs whiteout`),
ours from the image's layers (a .sif, owners kept: images/layers.py) and `apptainer build` (what
`convert` runs where there is Apptainer), each from the same registry into a folder of its own,
the variants interleaved round by round (the machine is shared and noisy).

Needs enroot on PATH (.ci/provision.sh builds it into /opt/harbor-hpc-ci/enroot/bin), Apptainer,
and the image in a registry this machine reaches (plain HTTP on loopback).

Usage: uv run python bench/bench_convert_layers.py --image localhost:5000/NAME:TAG [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench_enroot import enroot_env

from harbor_hpc.containers.store import ensure_sif
from harbor_hpc.core.scratch import remove_private_dir
from harbor_hpc.runtimes.apptainer import find_apptainer, zstd_here
from harbor_hpc.runtimes.enroot import find_enroot


def enroot_import(image: str, folder: Path) -> float:
    host, _, name = image.partition("/")
    env = {**enroot_env(folder / "enroot"), "ENROOT_ALLOW_HTTP": "y"}
    began = time.perf_counter()
    subprocess.run(
        [
            *("unshare", "--map-root-user", "--map-auto", "enroot", "import"),
            *("-o", str(folder / "image.sqsh"), f"docker://{host}#{name}"),
        ],
        env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return time.perf_counter() - began


def ours(image: str, folder: Path, *, apptainer: bool) -> float:
    """`convert`'s own conversion into a new store: with Apptainer, or without it."""
    if apptainer:
        os.environ.pop("HARBOR_HPC_APPTAINER", None)
    else:
        os.environ["HARBOR_HPC_APPTAINER"] = str(folder / "no-apptainer")
    find_apptainer.cache_clear()
    zstd_here.cache_clear()
    began = time.perf_counter()
    ensure_sif(image, folder / "store")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if find_enroot() is None:
        raise SystemExit("enroot is not on PATH")
    scratch = Path(tempfile.mkdtemp(prefix="bench-convert-layers-"))
    times: dict[str, list[float]] = {
        "enroot import (.sqsh)": [],
        "ours, from layers (.sif)": [],
        "apptainer build (.sif)": [],
    }
    try:
        for number in range(args.rounds):
            round_dir = scratch / str(number)
            for name in times:
                folder = round_dir / name.split()[0]
                folder.mkdir(parents=True)
                if name.startswith("enroot"):
                    times[name].append(enroot_import(args.image, folder))
                else:
                    times[name].append(ours(args.image, folder, apptainer="apptainer" in name))
            subprocess.run(
                ["unshare", "--map-root-user", "--map-auto", "rm", "-rf", str(round_dir)]
            )
    finally:
        remove_private_dir(scratch)
    anchor = statistics.median(times["enroot import (.sqsh)"])
    print(f"{args.image}, {args.rounds} rounds (median seconds, ratio to enroot import)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:26} {median:7.2f} s   x{median / anchor:.2f}")


if __name__ == "__main__":
    main()
