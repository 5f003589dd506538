"""Which programs an image has, for an agent that runs them in the container: asked once per
image, kept beside its .sif.

terminus-2 drives a tmux session running bash in the container. In an image without tmux it
spends minutes trying to install it (a compute node rarely reaches a package mirror), then fails
with `tmux: command not found`; without bash nothing it types runs. Every trial of the batch
fails so, one after another. `submit` asks each .sif once, before anything is queued (a shell
in it, or, where the node has no Apptainer, the listing of its root file system), and the
answer is kept in TOOLS_SUFFIX beside the .sif (keyed by its size and time), so a store shared
by many runs is asked once; where the store is not the user's to write, the answer is simply
not kept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from harbor_hpc.containers.sif import image_config, root_partition
from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_write_json, read_json
from harbor_hpc.core.proc import run
from harbor_hpc.images.dockerfile import DEFAULT_PATH
from harbor_hpc.runtimes.apptainer import apptainer_here, run_flags, try_exec

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
        found = _on_path(sif, tools) if apptainer_here() else _listed(sif, tools)
        if found is None:
            return []
        have = {tool: tool in found for tool in tools}
        _keep(sif, have)
    return [tool for tool in tools if not have[tool]]


def _on_path(sif: Path, tools: tuple[str, ...]) -> set[str] | None:
    """Those of `tools` a shell in `sif` finds (`command -v`); None: it does not run here."""
    script = "".join(f"command -v {tool} >/dev/null 2>&1 && echo {tool}; " for tool in tools)
    try:
        ran = try_exec(sif, run_flags(sif), script + "exit 0")
    except HarborHpcError:
        return None
    return set(ran.stdout.split()) if ran.ok else None


def _listed(sif: Path, tools: tuple[str, ...]) -> set[str] | None:
    """Those of `tools` that are programs in a folder of the image's PATH, read from the
    listing of its root file system (a node without Apptainer: enroot's), symbolic links
    followed as the container would; None: the listing cannot be read here."""
    partition = root_partition(sif)
    if partition is None or shutil.which("unsquashfs") is None:
        return None
    listed = run(["unsquashfs", "-o", str(partition.offset), "-lls", str(sif)], timeout=120)
    if not listed.ok:
        return None
    entries: dict[str, tuple[str, str]] = {}  # path in the image: its mode, its link's target
    for line in listed.stdout.splitlines():
        mode, _, rest = line.partition(" ")
        name, _, target = rest.partition(" -> ")
        path = name.split(" squashfs-root", 1)[-1] if " squashfs-root" in name else ""
        if path.startswith("/"):
            entries[path] = (mode, target)

    def program(path: str, hops: int = 0) -> bool:
        parts = [part for part in path.split("/") if part]
        for i in range(1, len(parts) + 1):
            mode, target = entries.get("/" + "/".join(parts[:i]), ("", ""))
            if mode.startswith("l") and hops < 16:
                base = "/" + "/".join(parts[: i - 1])
                whole = target if target.startswith("/") else f"{base}/{target}"
                return program(os.path.normpath("/".join([whole, *parts[i:]])), hops + 1)
            if not mode:
                return False
        return mode.startswith("-") and "x" in mode

    config = image_config(sif)
    folders = ((config.env if config else {}).get("PATH") or DEFAULT_PATH).split(":")
    return {tool for tool in tools if any(program(f"{folder}/{tool}") for folder in folders)}


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
