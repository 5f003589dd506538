"""How pytest-xdist hands the tests to its workers: by the groups the workers wrote down.

xdist's own `--dist loadgroup` puts a test's group into its node id, which pytest 9 no longer
lets a plugin change (the group is silently lost). So each worker writes the groups of its
collection into the run's folder (tests/conftest.py), and the scheduler here reads them: a
group goes to one worker, its tests one after another; any other test is a group of its own.
Groups are handed out in the order of the collection (tests/conftest.py sorts it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

GROUPS_FILE = "xdist-groups.json"


def write_groups(folder: Path, groups: dict[str, str]) -> None:
    """Record `groups` (node id: group) for the scheduler; whole, whichever worker is last."""
    partial = folder / f".{GROUPS_FILE}.{os.getpid()}"
    partial.write_text(json.dumps(groups))
    partial.rename(folder / GROUPS_FILE)


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no type hints
    """xdist's scheduling by scope, a scope being the group a worker wrote for a test."""

    def __init__(self, config: Any, log: Any, *, folder: Path) -> None:
        super().__init__(config, log)
        self.groups_file = folder / GROUPS_FILE
        self.groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:  # read once every worker collected, when the scheduling starts
            self.groups = json.loads(self.groups_file.read_text())
        return self.groups.get(nodeid, nodeid)
