"""One step of a batch that goes on past a failure: done (with what it made), skipped or failed.

Work over many tasks or files (hashing each build context, choosing each task's docker_image,
planning each file of a fetch) must not stop at the first that cannot go on: each gives a
`Step`, the caller collects them and the CLI renders them (and `--json` from the same object).
What ends the whole command is still raised (`HarborHpcError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Never


class State(StrEnum):
    DONE = "done"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class Step[T]:
    state: State
    # What a done step made; None for the others.
    value: T | None = None
    # Why a step was skipped or failed: one line, naming the task, file or value.
    reason: str = ""


def done[T](value: T) -> Step[T]:
    return Step(State.DONE, value)


def skipped(reason: str) -> Step[Never]:
    return Step(State.SKIPPED, None, reason)


def failed(reason: str) -> Step[Never]:
    return Step(State.FAILED, None, reason)
