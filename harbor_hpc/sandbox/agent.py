"""The Harbor agent of a sandbox's trial: it hands the environment to the trainer and waits.

Harbor runs it as any agent (`AgentConfig(import_path=AGENT)`): in its setup it says the
environment is up and waits until a trainer claims the sandbox (a sandbox started ahead waits
here, where no agent timeout runs); its run, timed by the task's [agent] timeout_sec as every
agent's, lasts until the trainer asks for the reward. What the trainer does in between is the
agent's episode.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, override

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

AGENT = "harbor_hpc.sandbox.agent:TrainerDriven"


@dataclass
class Handoff:
    """What a sandbox and its trial's agent share, on the sandboxes' loop."""

    environment: asyncio.Future[BaseEnvironment] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    running: asyncio.Event = field(default_factory=asyncio.Event)
    # The trainer asked for the reward; `over`: the episode ended (that, or the agent timeout).
    done: asyncio.Event = field(default_factory=asyncio.Event)
    over: asyncio.Event = field(default_factory=asyncio.Event)


# Each sandbox's handoff, by the id its agent is given (a kwarg Harbor writes into config.json).
HANDOFFS: dict[str, Handoff] = {}


class TrainerDriven(BaseAgent):  # type: ignore[misc]  # harbor ships no types
    # The pool gives back a sandbox that waits longer than its idle time; Harbor's setup
    # timeout would otherwise end one started ahead before a trainer asked for it.
    DEFAULT_SETUP_TIMEOUT_SEC: ClassVar[float] = 7 * 24 * 3600.0

    def __init__(self, logs_dir: Path, *args: Any, sandbox: str = "", **kwargs: Any) -> None:
        super().__init__(logs_dir, *args, **kwargs)
        self._handoff = HANDOFFS[sandbox]

    @staticmethod
    def name() -> str:
        return "trainer"

    @override
    def version(self) -> str:
        return "1"

    @override
    async def setup(self, environment: BaseEnvironment) -> None:
        if not self._handoff.environment.done():
            self._handoff.environment.set_result(environment)
        await self._handoff.claimed.wait()

    @override
    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> None:
        self._handoff.running.set()
        try:
            await self._handoff.done.wait()
        finally:
            self._handoff.over.set()
