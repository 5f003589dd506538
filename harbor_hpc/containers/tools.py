"""Which programs an image has, for an agent that runs them in the container: asked once per
image, kept beside its .sif.

terminus-2 drives a tmux session running bash in the container. In an image without tmux it
spends minutes trying to install it (a compute node rarely reaches a package mirror), then fails
with `tmux: command not found`; without bash nothing it types runs. Every trial of the batch
fails so, one after another. `submit` asks each .sif once, before anything is queued, and the
answer is kept in TOOLS_SUFFIX beside the .sif (keyed by its size and time), so a store shared by
many runs is asked once; where the store is not the user's to write, the answer is simply not
kept.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_write_json, read_json
from harbor_hpc.runtimes.apptainer import run_flags, try_exec

TOOLS_SUFFIX = ".tools.json"

# What Harbor's agents run inside the container, by agent name.
AGENT_TOOLS: dict[str, tuple[str, ...]] = {
    name: ("bash", "tmux") for name in ("terminus", "terminus-1", "terminus-2")
}


def missing_tools(sif: Path, tools: tuple[str, ...]) -> list[str]:
    """Those of `tools` that `sif` lacks on its PATH ([] when it has them all, or when the image
    cannot be run here at all: the environment's start names that)."""
    if not tools:
        return []
    have = _known(sif, tools)
    if have is None:
        script = "".join(f"command -v {tool} >/dev/null 2>&1 && echo {tool}; " for tool in tools)
        try:
            ran = try_exec(sif, run_flags(sif), script + "exit 0")
        except HarborHpcError:
            return []
        if not ran.ok:
            return []
        found = set(ran.stdout.split())
        have = {tool: tool in found for tool in tools}
        _keep(sif, have)
    return [tool for tool in tools if not have[tool]]


def _stamp(sif: Path) -> list[int]:
    info = sif.stat()
    return [info.st_size, info.st_mtime_ns]


def _known(sif: Path, tools: tuple[str, ...]) -> dict[str, bool] | None:
    try:
        kept = read_json(sif.with_name(sif.name + TOOLS_SUFFIX))
        if kept.get("stamp") != _stamp(sif):
            return None
        have = {tool: bool(kept["have"][tool]) for tool in tools}
    except (HarborHpcError, OSError, AttributeError, KeyError, TypeError):
        return None
    return have


def _keep(sif: Path, have: dict[str, bool]) -> None:
    with contextlib.suppress(OSError, HarborHpcError):
        path = sif.with_name(sif.name + TOOLS_SUFFIX)
        stamp = _stamp(sif)
        try:
            found = read_json(path)
            kept = found["have"] if found.get("stamp") == stamp else {}
        except (HarborHpcError, AttributeError, KeyError, TypeError):
            kept = {}
        atomic_write_json(path, {"stamp": stamp, "have": {**kept, **have}}, mode=0o644)
