"""One step of a batch that goes on past a failure: done (with what it made), skipped or failed.

Work over many tasks or files (hashing each build context, choosing each task's docker_image,
planning each file of a fetch) must not stop at the first that cannot go on: each gives a
`Step`, the caller collects them and the CLI renders them (and `--json` from the same object).
What ends the whole command is still raised (`HarborHpcError`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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


def map_in_threads[T, R](action: Callable[[T], R], items: Sequence[T], jobs: int) -> list[R]:
    """`action` on each item, in `jobs` threads; the results in the items' order.

    For the small file operations on each task of a dataset: threads overlap the waits of a
    shared filesystem (NFS, Lustre), where each operation is a round trip. Items go out in a few
    chunks per thread, as a future for each item costs more than the operation does.
    """
    if jobs <= 1 or len(items) <= 1:
        return [action(item) for item in items]
    size = -(-len(items) // (jobs * 4))
    chunks = [items[start : start + size] for start in range(0, len(items), size)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = pool.map(lambda chunk: [action(item) for item in chunk], chunks)
        return [result for chunk in done for result in chunk]
