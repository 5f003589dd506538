"""How long `harbor-hpc` takes to start, side by side in one run: `--help`, `status --help`,
`doctor --help` and `status` itself (on a folder that is not a run: it exits as soon as it
starts work), beside the floor every Typer command line pays (running a one-option Typer
subcommand, which loads Typer's pydantic adapters), what Rich's help would add to it (harbor-hpc
prints Click's plain help), and a bare Python. Each is the median of several runs of a fresh
process. The goal (issue 25): each under 0.3 s.

Usage: uv run python bench/bench_startup.py [--runs 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

# The least a Typer command line with one subcommand and one option does before its work.
TYPER_SUBCOMMAND = """
import pathlib, typer
app = typer.Typer()
@app.command()
def x(path: pathlib.Path = typer.Option(...)) -> None: pass
@app.command()
def y() -> None: pass
app()
"""


def median_seconds(command: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    cli = shutil.which("harbor-hpc") or "harbor-hpc"
    variants = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "a Typer subcommand (floor)": [sys.executable, "-c", TYPER_SUBCOMMAND, "x", "--path", "."],
        "import typer + Rich help (not used)": [
            sys.executable, "-c", "import typer, typer.rich_utils",
        ],
        "harbor-hpc --help": [cli, "--help"],
        "harbor-hpc status --help": [cli, "status", "--help"],
        "harbor-hpc doctor --help": [cli, "doctor", "--help"],
        "harbor-hpc status NOT-A-RUN": [cli, "status", "/nonexistent-run"],
    }  # fmt: skip
    figures = {name: median_seconds(command, args.runs) for name, command in variants.items()}
    floor = figures["a Typer subcommand (floor)"]
    for name, seconds in figures.items():
        print(f"{name:36} {seconds:6.3f} s  ({seconds / floor:4.2f}x the floor)")


if __name__ == "__main__":
    main()
