"""Our environment as the tests make it: one constructor, and one started for a `with` block."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.containers.environment import SingularityEnvironment


def make_environment(
    image: str | Path,
    folder: Path,
    env_dir: Path | None = None,
    *,
    name: str = "unit",
    memory_mb: int | None = None,
    **kwargs: Any,
) -> SingularityEnvironment:
    """A `SingularityEnvironment` of `image` whose trial folder is `folder/trial` and whose
    task's environment folder is `env_dir` (made if missing; `folder` by default); `kwargs`
    are its options."""
    trial_paths = TrialPaths(folder / "trial")
    trial_paths.mkdir()
    if env_dir is not None:
        env_dir.mkdir(parents=True, exist_ok=True)
    return SingularityEnvironment(
        environment_dir=env_dir or folder,
        environment_name=name,
        session_id=f"{name}__env",
        trial_paths=trial_paths,
        task_env_config=EnvironmentConfig(docker_image=str(image), memory_mb=memory_mb),
        logger=logging.getLogger("test"),
        **kwargs,
    )


@asynccontextmanager
async def started(
    image: str | Path, folder: Path, env_dir: Path | None = None, **kwargs: Any
) -> AsyncIterator[SingularityEnvironment]:
    """`make_environment`'s environment, started, and stopped (deleted) after the block."""
    environment = make_environment(image, folder, env_dir, **kwargs)
    await environment.start(force_build=False)
    try:
        yield environment
    finally:
        await environment.stop(delete=True)
