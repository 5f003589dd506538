"""The agent's model calls, as the process that ran the trial saw them: the evidence that tells
a policy's outcome from one the model server made.

Harbor records a failure by its exception's name: an agent whose time ran out raised
`AgentTimeoutError`, whatever it was doing then. Running a command the policy chose and waiting
on a model server that hangs look alike there, and so do a policy that wrote nothing and a server
that answered nothing. So the worker that runs trials (every backend of `submit` and
`run_rollouts`) writes CALLS_FILE into each trial's folder: per model call that litellm made
(`litellm.acompletion` and `aresponses`, what Harbor's LiteLLM and so terminus-2 call), when it
began, how long it took, and how it ended:

    answered   the server answered; `tokens` says whether the answer carried the token ids and
               log-probs that the call asked for (None: it asked for none)
    failed     litellm raised (`error`: its name and first words); the agent may have retried
    cut_off    the call was still waiting on the server when the agent was stopped (its time
               ran out, or the run was cancelled)

The file is rewritten (atomically) as each call ends, so it is whole before Harbor's verifier
starts, and so before result.json appears. `results/classify.py` reads it; a trial without one
(an agent that calls no model through litellm, a trial a trainer ran itself) is judged on what
Harbor recorded alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.abc
import importlib.util
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from harbor_hpc.core.errors import HarborHpcError
from harbor_hpc.core.files import atomic_write_json, read_json

CALLS_FILE = "model-calls.json"
SCHEMA = "harbor-hpc/model-calls/v1"
ERROR_WORDS = 200


class CallEnd(StrEnum):
    ANSWERED = "answered"
    FAILED = "failed"
    CUT_OFF = "cut_off"


@dataclass
class Call:
    started_at: str
    seconds: float
    end: CallEnd
    error: str | None = None
    tokens: bool | None = None


@dataclass
class ModelCalls:
    """A trial's model calls, oldest first."""

    calls: list[Call] = field(default_factory=list)

    @property
    def answered(self) -> list[Call]:
        return [call for call in self.calls if call.end is CallEnd.ANSWERED]

    @property
    def without_tokens(self) -> list[Call]:
        """Answers that lack the token ids or log-probs their call asked for."""
        return [call for call in self.answered if call.tokens is False]

    @property
    def last_error(self) -> str | None:
        return next((c.error for c in reversed(self.calls) if c.end is CallEnd.FAILED), None)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "calls": [asdict(call) for call in self.calls]}


def read_calls(trial_dir: Path) -> ModelCalls | None:
    """The trial's model calls, or None where nothing recorded them."""
    try:
        data = read_json(trial_dir / CALLS_FILE)
    except HarborHpcError:
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    calls = []
    for entry in data.get("calls") or []:
        try:
            calls.append(
                Call(
                    started_at=str(entry["started_at"]),
                    seconds=float(entry["seconds"]),
                    end=CallEnd(entry["end"]),
                    error=entry.get("error"),
                    tokens=entry.get("tokens"),
                )
            )
        except (KeyError, TypeError, ValueError):
            continue  # a foreign entry must not hide the others
    return ModelCalls(calls)


class _Ledger:
    """One trial's calls, written to its folder as each ends."""

    def __init__(self, trial_dir: Path) -> None:
        self.path = trial_dir / CALLS_FILE
        self.calls = ModelCalls()
        self.lock = threading.Lock()

    def add(self, call: Call) -> None:
        with self.lock:
            self.calls.calls.append(call)
            with contextlib.suppress(OSError):  # a full disk: the trial's own files say so
                atomic_write_json(self.path, self.calls.to_json())


_current: contextvars.ContextVar[_Ledger | None] = contextvars.ContextVar(
    "harbor_hpc_model_calls", default=None
)
_install_lock = threading.Lock()
_WRAPPED = "_harbor_hpc_recorded"


@contextlib.contextmanager
def recording_calls(trial_dir: Path) -> Iterator[None]:
    """Record the model calls made inside this block (in this task and every task it starts)
    into `trial_dir`'s CALLS_FILE. Nothing is written for a trial that makes none."""
    _install()
    token = _current.set(_Ledger(trial_dir))
    try:
        yield
    finally:
        _current.reset(token)


def _install() -> None:
    """Wrap litellm's async entry points in this process, once, as soon as litellm is there:
    now, or when the agent imports it (Harbor's LiteLLM, and so terminus-2, did when Harbor made
    the agent; another may at its first call). Importing it here would cost each worker that
    runs an agent calling no model (oracle, an installed agent) some 3 CPU seconds."""
    litellm = sys.modules.get("litellm")
    if litellm is not None:
        _wrap(litellm)
        return
    with _install_lock:
        if not any(isinstance(finder, _WrapOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _WrapOnImport())


def _wrap(litellm: ModuleType) -> None:
    with _install_lock:
        for name in ("acompletion", "aresponses"):
            function = getattr(litellm, name, None)
            if function is not None and not getattr(function, _WRAPPED, False):
                setattr(litellm, name, _recorded(function))


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds litellm as the finders after it do, and wraps it once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != "litellm":
            return None
        sys.meta_path.remove(self)  # once: the real spec, from the other finders
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None:
            return spec
        run_module = loader.exec_module

        def run_and_wrap(module: ModuleType) -> None:
            run_module(module)
            _wrap(module)

        loader.exec_module = run_and_wrap  # type: ignore[method-assign]
        return spec


def _recorded(function: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def recorded(*args: Any, **kwargs: Any) -> Any:
        ledger = _current.get()
        if ledger is None:
            return await function(*args, **kwargs)
        started_at = datetime.now(UTC).isoformat()
        began = time.monotonic()

        def add(end: CallEnd, error: str | None = None, tokens: bool | None = None) -> None:
            seconds = round(time.monotonic() - began, 3)
            ledger.add(Call(started_at, seconds, end, error, tokens))

        try:
            response = await function(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, Exception):
                words = " ".join(str(exc).split())[:ERROR_WORDS]
                add(CallEnd.FAILED, f"{type(exc).__name__}: {words}")
            else:  # cancelled (the agent's time ran out, the run was cancelled), or exiting
                add(CallEnd.CUT_OFF)
            raise
        add(CallEnd.ANSWERED, tokens=_carries_tokens(kwargs, response))
        return response

    setattr(recorded, _WRAPPED, True)
    return recorded


def _carries_tokens(request: dict[str, Any], response: Any) -> bool | None:
    """Whether an answer carries the token ids and log-probs its request asked for (None: it
    asked for none), where Harbor's LiteLLM reads them (`_extract_token_ids`, `logprobs`)."""
    asked = bool((request.get("extra_body") or {}).get("return_token_ids"))
    if not asked:
        return None
    try:
        choice = response["choices"][0]
        fields = getattr(choice, "provider_specific_fields", None) or {}
        content = getattr(getattr(choice, "logprobs", None), "content", None)
        if content is None and isinstance(getattr(choice, "logprobs", None), dict):
            content = choice.logprobs.get("content")
        return (
            isinstance(fields.get("token_ids"), list)
            and getattr(response, "prompt_token_ids", None) is not None
            and bool(content)
        )
    except (KeyError, IndexError, TypeError, AttributeError):
        return False
