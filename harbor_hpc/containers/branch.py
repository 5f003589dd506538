"""Where a forked container's trial branched: `branch.json` in its trial folder, the trial it
was forked from and the step of that episode (snapshot.py's `branch_record`), which its rollout
line carries (results/rollout.py), so that a trainer can rebuild the tree of a branching
rollout. Read where a command must start quickly: nothing here but the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harbor_hpc.core.files import atomic_write_text

BRANCH = "branch.json"


def write_branch(trial_dir: Path, record: dict[str, Any]) -> None:
    atomic_write_text(trial_dir / BRANCH, json.dumps(record) + "\n")


def read_branch(trial_dir: Path) -> dict[str, Any] | None:
    """The record in `trial_dir`, or None: not a fork's trial."""
    try:
        record: dict[str, Any] = json.loads((trial_dir / BRANCH).read_text())
    except (OSError, ValueError):
        return None
    return record
