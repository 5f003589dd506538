"""Which environment kwargs a Harbor environment class takes (`--environment-kwarg NAME=...`):
the one definition `submit` checks before queueing and our environment checks when created."""

from __future__ import annotations

import inspect
from typing import Any

# The environment `submit` runs trials in unless told otherwise, by the import path Harbor takes.
ENVIRONMENT = "harbor_hpc.environment:SingularityEnvironment"

HARBOR_PASSES = frozenset(
    {
        "environment_dir",
        "environment_name",
        "session_id",
        "trial_paths",
        "task_env_config",
        "logger",
        "mounts",
        "network_policy",
        "phase_network_policies",
        "enable_environment_dir_upload",
        "stream",
    }
)


def accepted_environment_kwargs(cls: type) -> list[str]:
    """The kwargs users may pass `cls`: the named parameters of `__init__` along its MRO, up to
    and including Harbor's BaseEnvironment, less those Harbor passes itself; with those of the
    class it hands the rest to (`kwargs_forwarded_to`), if any."""
    from harbor.environments.base import BaseEnvironment

    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and klass is not object:
            parameters = inspect.signature(init).parameters.values()
            names |= {p.name for p in parameters if p.kind in named and p.name != "self"}
        if klass is BaseEnvironment:
            break
    forwarded_to = getattr(cls, "kwargs_forwarded_to", None)
    if forwarded_to is not None:
        names |= set(accepted_environment_kwargs(forwarded_to))
    return sorted(names - HARBOR_PASSES)


def flag(value: Any) -> bool:
    """A boolean kwarg as `--environment-kwarg k=v` may deliver it (JSON or a plain string)."""
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)
