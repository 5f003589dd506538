"""An installed agent for tests (one of Harbor's `BaseInstalledAgent`: it runs inside the
container), named by import path: it needs its variables there, as claude-code or codex need
their key. It solves the `secret` sample task (42 into /tmp/answer when the container has
HH_TEST_SECRET=s3cr3t-2f9a, tests/support/sample_tasks.py) and keeps, in its trial's agent/
folder, what the container said of its variables (SAID_FILE): the text Harbor's redaction goes
over.
"""

from __future__ import annotations

from typing import Any

from harbor.agents.installed.base import BaseInstalledAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext

AGENT = "tests.support.installed_agent:InstalledAgent"
SAID_FILE = "said.txt"
# The secret, a placeholder (what a server without keys is given), and words like it.
COMMAND = (
    'echo "secret=$HH_TEST_SECRET key=$OPENAI_API_KEY"; echo "--network none, EMPTY, dummy"; '
    '[ "$HH_TEST_SECRET" = s3cr3t-2f9a ] && echo 42 > /tmp/answer'
)


class InstalledAgent(BaseInstalledAgent):  # type: ignore[misc]  # harbor ships no types
    @staticmethod
    def name() -> str:
        return "installed-probe"

    def version(self) -> str:
        return "1.0.0"

    async def install(self, environment: BaseEnvironment) -> None:
        pass

    async def run(
        self, instruction: str, environment: BaseEnvironment, context: AgentContext
    ) -> Any:
        result = await self.exec_as_agent(environment, COMMAND)
        (self.logs_dir / SAID_FILE).write_text(result.stdout or "")
