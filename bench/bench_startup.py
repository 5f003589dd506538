"""How long `harbor-hpc` takes to start, side by side in one run: `--help`, `status --help` and
`doctor --help`, beside the floor every Typer command line with Rich help pays (importing typer
and its Rich help renderer) and a bare Python. Each is the median of several runs of a fresh
process.

Usage: uv run python bench/bench_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def median_seconds(command: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    cli = shutil.which("harbor-hpc") or "harbor-hpc"
    variants = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "import typer + Rich help (floor)": [
            sys.executable, "-c", "import typer, typer.rich_utils",
        ],
        "harbor-hpc --help": [cli, "--help"],
        "harbor-hpc status --help": [cli, "status", "--help"],
        "harbor-hpc doctor --help": [cli, "doctor", "--help"],
    }  # fmt: skip
    figures = {name: median_seconds(command, args.runs) for name, command in variants.items()}
    floor = figures["import typer + Rich help (floor)"]
    for name, seconds in figures.items():
        print(f"{name:36} {seconds:6.3f} s  ({seconds / floor:4.2f}x the floor)")


if __name__ == "__main__":
    main()
