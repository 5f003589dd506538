"""TRL's Harbor environments on our sandboxes: `GRPOTrainer(environment_factory=...)`.

    from functools import partial
    from harbor_hpc.trl import HarborBashEnv
    factory = partial(HarborBashEnv, executor="local", ahead=7, environment_kwargs={...})
    trainer = GRPOTrainer(..., environment_factory=factory)   # no reward_funcs: get_reward

`HarborEnv` is TRL's own `trl.experimental.harbor.HarborEnv` (1.16) with its sandbox taken
from a `harbor_hpc.sandbox` pool, one per setting in each process: `reset` returns the task's
instruction at once while its sandbox starts (a batch's serial resets start side by side), a
tool call waits for it; `get_reward()` runs the task's verifier as Harbor's trial does and
returns the reward where the policy alone made it, else None (TRL skips it), the reason logged
and in `outcome` (and, with `record`, a line in that JSONL file). Settings are keyword
arguments (a `functools.partial` carries them, and pickles, for AsyncGRPOTrainer's worker) or
class attributes of a subclass. `trl` itself is not our dependency: install it beside us.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

from trl.experimental.harbor import HarborBashEnv as _TrlHarborBashEnv
from trl.experimental.harbor import HarborEnv as _TrlHarborEnv

from harbor_hpc.core.errors import InputError
from harbor_hpc.sandbox.loop import run_sync
from harbor_hpc.sandbox.pool import (
    Sandbox,
    SandboxEnded,
    SandboxOptions,
    SandboxPool,
    SandboxResult,
)

log = logging.getLogger(__name__)

# TRL's own `environment_type` values that mean our environment: its default ("docker"), and
# the names of where ours runs.
_LOCAL_TYPES = ("docker", "singularity", "apptainer", "local")

_pools: dict[str, SandboxPool] = {}
_pools_lock = threading.Lock()


def _pool(options: SandboxOptions) -> SandboxPool:
    """This process's pool for `options` (one per setting, made on first use: in the
    process that uses it, AsyncGRPOTrainer's worker included)."""
    key = json.dumps({name: str(value) for name, value in vars(options).items()}, sort_keys=True)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = SandboxPool(options)
        return pool


class HarborEnv(_TrlHarborEnv):  # type: ignore[misc,unused-ignore]  # Any without trl
    """TRL's HarborEnv on harbor-hpc's sandboxes (see the module's docstring)."""

    executor: ClassVar[str] = "local"
    environment_kwargs: ClassVar[dict[str, Any]] = {}
    ahead: ClassVar[int] = 0
    starts: ClassVar[int] = 4
    idle_sec: ClassVar[float] = 600.0
    reward_key: ClassVar[str | None] = None
    record: ClassVar[str | None] = None

    def __init__(
        self,
        environment_type: str = "docker",
        *,
        executor: str | None = None,
        environment_kwargs: dict[str, Any] | None = None,
        ahead: int | None = None,
        starts: int | None = None,
        idle_sec: float | None = None,
        reward_key: str | None = None,
        record: str | os.PathLike[str] | None = None,
    ) -> None:
        # TRL's own __init__ starts an event loop per environment: ours share the sandboxes'.
        if environment_type == "ray":
            executor = executor or "ray"
        elif environment_type not in _LOCAL_TYPES:
            raise InputError(
                f"environment_type={environment_type!r}: harbor_hpc.trl runs harbor-hpc's "
                "environment; choose where with executor= (local, ray)"
            )
        self._environment_type = environment_type
        self._options = SandboxOptions(
            executor=executor or self.executor,
            environment_kwargs=dict(environment_kwargs or self.environment_kwargs),
            reward_key=reward_key or self.reward_key,
            ahead=self.ahead if ahead is None else ahead,
            starts=self.starts if starts is None else starts,
            idle_sec=self.idle_sec if idle_sec is None else idle_sec,
        )
        chosen = record or self.record
        self._record = Path(chosen) if chosen else None
        if self._record is not None:
            try:  # refused here, once, not at the first reward
                self._record.parent.mkdir(parents=True, exist_ok=True)
                os.close(os.open(self._record, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
            except OSError as exc:
                raise InputError(
                    f"record={str(chosen)!r}: cannot write it ({exc.strerror})",
                    hint="name a file in a folder of yours",
                ) from None
        self._sandbox: Sandbox | None = None
        self._outcome: SandboxResult | None = None
        self._prepared = False
        self._env = None  # TRL's name for the live Harbor environment (harness `_setup`s use it)
        self._pool = _pool(self._options)  # settings refused here, once, before any rollout

    def __getstate__(self) -> dict[str, Any]:
        # What a spawned process needs to make its own (its pool and sandboxes are its own).
        return {
            "environment_type": self._environment_type,
            "options": self._options,
            "record": self._record,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        options: SandboxOptions = state["options"]
        self.__init__(  # type: ignore[misc]
            state["environment_type"],
            executor=str(options.executor),
            environment_kwargs=options.environment_kwargs,
            ahead=options.ahead,
            starts=options.starts,
            idle_sec=options.idle_sec,
            reward_key=options.reward_key,
            record=state["record"],
        )

    def reset(self, task_dir: str | None = None, **kwargs: Any) -> str:
        """Give back the last rollout's sandbox (where its reward was never asked for) and
        open one for `task_dir` (the dataset row's); its instruction, at once."""
        if task_dir is None:
            raise InputError("HarborEnv.reset requires `task_dir` (provided by the dataset row)")
        if self._sandbox is not None and self._outcome is None:
            self._sandbox.close()
        self._sandbox = self._pool.open(task_dir)
        self._outcome = None
        self._prepared = False
        self._env = None
        return self._sandbox.instruction + str(self.PROMPT_SUFFIX)

    def _live(self) -> Sandbox:
        if self._sandbox is None:
            raise InputError("call reset(task_dir) before the environment's tools")
        return self._sandbox

    def _exec(self, command: str, timeout: int = 180) -> str:
        """Run a shell command in the sandbox; combined stdout+stderr, as TRL's (8k at most).
        A sandbox that ended (its start failed, its episode's time ran out) says so."""
        sandbox = self._live()
        try:
            if not self._prepared:
                self._prepare(sandbox)
            result = sandbox.exec(command, timeout_sec=timeout)
        except SandboxEnded as ended:
            return f"(the sandbox has ended: {ended.message})"
        out = (result.stdout or "") + (result.stderr or "")
        if len(out) > 8000:
            out = out[:8000] + "\n... [truncated]"
        return out or f"(empty output, rc={result.return_code})"

    def _prepare(self, sandbox: Sandbox) -> None:
        """TRL's base setup (its /workdir and /home/user/input), then the harness's `_setup`."""
        sandbox.exec("mkdir -p /workdir /home/user/input")

        async def setup() -> None:
            self._env = await sandbox.aenvironment()
            await self._setup()

        run_sync(setup())
        self._prepared = True

    def get_reward(self) -> float | None:
        """The rollout's reward where the policy alone made it; else None, which TRL skips,
        with what failed logged and in `outcome`."""
        if self._sandbox is None:
            return None
        if self._outcome is None:
            self._outcome = self._sandbox.verify()
            self._note(self._outcome)
        return self._outcome.training_reward

    @property
    def reward(self) -> float:
        """TRL's `env.reward` (its HarborSpec's reward function reads it): `get_reward()`,
        NaN where that is None (a reward TRL's GRPO leaves out)."""
        reward = self.get_reward()
        return math.nan if reward is None else reward

    @property
    def outcome(self) -> SandboxResult | None:
        """What the last rollout's sandbox came to, once its reward was asked for."""
        return self._outcome

    def _note(self, outcome: SandboxResult) -> None:
        if not outcome.trainable:
            log.warning(
                "task %s: no reward to train on (%s): %s",
                outcome.task,
                outcome.failure,
                outcome.message,
            )
        if self._record is not None:
            line = {
                "task": str(outcome.task),
                "reward": outcome.reward,
                "trainable": outcome.trainable,
                "failure": outcome.failure,
                "message": outcome.message,
                "rewards": outcome.rewards,
            }
            data = (json.dumps(line) + "\n").encode()
            # One write of a whole line, appended: lines of processes side by side never mix.
            descriptor = os.open(self._record, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(descriptor, data)
            finally:
                os.close(descriptor)

    def __del__(self) -> None:
        # At the interpreter's exit its pools were closed already (pool.py), every sandbox
        # with them: nothing to do, and the sandboxes' loop no longer runs.
        if sys.is_finalizing():
            return
        sandbox = getattr(self, "_sandbox", None)
        if sandbox is not None and getattr(self, "_outcome", None) is None:
            with contextlib.suppress(Exception):  # the interpreter may be going down
                sandbox.close()


class HarborBashEnv(HarborEnv, _TrlHarborBashEnv):  # type: ignore[misc,unused-ignore]
    """TRL's single-`bash`-tool harness (submit by writing /workdir/answer.txt) on our
    sandboxes."""
