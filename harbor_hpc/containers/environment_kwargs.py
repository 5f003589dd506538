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


def option_names(cls: type) -> set[str]:
    """The user-facing fields of `cls.options_model` (none where it declares no model)."""
    model = getattr(cls, "options_model", None)
    if model is None:
        return set()
    return {name for name, spec in model.model_fields.items() if not spec.exclude}


def accepted_environment_kwargs(cls: type) -> list[str]:
    """The kwargs users may pass `cls`: the fields of its `options_model` (Harbor's typed
    options) and the named parameters of `__init__` along its MRO, up to and including
    Harbor's BaseEnvironment, less those Harbor passes itself."""
    from harbor.environments.base import BaseEnvironment

    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names: set[str] = option_names(cls)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and klass is not object:
            parameters = inspect.signature(init).parameters.values()
            names |= {p.name for p in parameters if p.kind in named and p.name != "self"}
        if klass is BaseEnvironment:
            break
    return sorted(names - HARBOR_PASSES)


def flag(value: Any) -> bool:
    """A boolean kwarg as `--environment-kwarg k=v` may deliver it (JSON or a plain string)."""
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)
