"""The event loop this process's sandboxes live on, on a daemon thread of its own.

Harbor's environments are bound to the loop they started on; a trainer calls from its main
thread (GRPOTrainer), from a thread pool (AsyncGRPOTrainer's tools), or from coroutines of its
own loop. Every call is run here and waited for from where it was made.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Coroutine
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def sandbox_loop() -> asyncio.AbstractEventLoop:
    """The loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(
                target=loop.run_forever, name="harbor-hpc-sandboxes", daemon=True
            ).start()
            _loop = loop
        return _loop


def on_sandbox_loop() -> bool:
    try:
        return asyncio.get_running_loop() is _loop
    except RuntimeError:
        return False


def run_sync[T](coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run `coroutine` on the sandboxes' loop and wait for it here (a thread, not the loop)."""
    if on_sandbox_loop():
        coroutine.close()
        raise RuntimeError("a sandbox's blocking method was called on its own loop: await a...()")
    if sys.is_finalizing():  # the loop's thread is stopped for good: nothing would answer
        coroutine.close()
        raise RuntimeError("the interpreter is exiting: its sandboxes were stopped at its exit")
    return asyncio.run_coroutine_threadsafe(coroutine, sandbox_loop()).result(timeout)


async def run_async[T](coroutine: Coroutine[Any, Any, T]) -> T:
    """Await `coroutine` on the sandboxes' loop from whatever loop this is."""
    if on_sandbox_loop():
        return await coroutine
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, sandbox_loop()))
