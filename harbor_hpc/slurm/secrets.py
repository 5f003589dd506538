"""Where the agent's variables (`--agent-env`, a run's `agent_env`) go, and which are secrets.

The values are in the job's environment (submit exports them while it queues, waves.py), so the
worker's own process has them. Harbor hands an agent's `env` to every command it runs in the
container (`scoped_exec_env`), and terminus-2 starts its tmux with `-e NAME=VALUE`: the task's
processes could read the model server's key, and the policy did (`echo $OPENAI_API_KEY` went
back to the server in the next prompt, and into the exported tokens). So an agent that runs
here (terminus-2, oracle, any that is not one of Harbor's installed agents) gets no `env`: litellm
in this process finds the key where the agent's model connection looks, the process's
environment. Only an installed agent (claude-code, codex...: it runs inside the container and
calls the model from there) gets them as its `env`, in the container.

Harbor's trial then rewrites each value of a variable named like a secret, wherever it is in the
trial's files, as `[REDACTED]`. A value too short or too common to be a secret (`none`, `EMPTY`,
`dummy`: what a server without keys is given) rewrote every such word (`--network [REDACTED]`):
`is_secret` says which values are rewritten, and `redact_secrets_only` keeps the rest as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Shorter than this, a value is no secret (a key a server checks is longer).
SHORTEST_SECRET = 8
# Values given where a server checks no key (lower case): never secrets, whatever their length.
PLACEHOLDERS = frozenset(
    {
        "none", "null", "empty", "dummy", "unused", "no-key", "nokey", "placeholder",
        "not-needed", "not-used", "changeme", "password", "sk-no-key-required", "sk-dummy",
        "dummy-key", "fake-key", "test-key", "api-key", "apikey",
    }
)  # fmt: skip


def is_secret(value: str) -> bool:
    """Whether `value` is one to hide wherever it appears: long enough, and no placeholder."""
    text = value.strip()
    return len(text) >= SHORTEST_SECRET and text.lower() not in PLACEHOLDERS


def runs_in_container(fields: dict[str, Any]) -> bool:
    """Whether the agent of Harbor's AgentConfig `fields` runs inside the container (one of
    Harbor's installed agents), and so needs its variables there. An agent Harbor cannot find
    runs nowhere: the trial fails on it, with Harbor's error."""
    from harbor.agents.factory import AgentFactory
    from harbor.agents.installed.base import BaseInstalledAgent
    from harbor.models.trial.config import AgentConfig

    try:
        agent = AgentFactory.get_agent_class_from_config(AgentConfig(**fields))
    except Exception:  # unknown name, an import path that does not import
        return False
    return isinstance(agent, type) and issubclass(agent, BaseInstalledAgent)


_installed = False


def redact_secrets_only() -> None:
    """Have Harbor's trials in this process rewrite, of the values they would hide in a trial's
    files, only those that are secrets (`is_secret`). Harbor's trial collects them (the agent's
    variables named like secrets, its model key) and hands them to `scrub_file_text`, which
    this wraps once."""
    global _installed
    if _installed:
        return
    import harbor.trial.trial as trial

    scrub = getattr(trial, "scrub_file_text", None)
    if scrub is None:  # a Harbor that redacts otherwise: tests/e2e/test_secrets.py says so
        log.warning("Harbor's trial has no scrub_file_text: placeholders may be redacted")
        return

    def scrub_secrets(path: Path, text: str, secrets: Sequence[str]) -> str:
        return str(scrub(path, text, [secret for secret in secrets if is_secret(secret)]))

    trial.scrub_file_text = scrub_secrets
    _installed = True
