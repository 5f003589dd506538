"""What a compose service beside a task costs to start, side by side in one run: the task alone
and the task with one service it waits for (`depends_on: service_healthy`, a Python HTTP server
and its healthcheck), here (one pod of Apptainer containers) and in Harbor's Docker environment
(`docker compose`, what users would run instead), on the same image: the .sif made from the
Docker image. Start is to the first possible exec; then an exec in the service, then stop
(Docker's stop waits out its 10 s grace for each container whose process ignores SIGTERM,
`sleep infinity` among them: what Harbor's Docker environment costs its users).

Needs Docker Engine with Compose v2 and the image in Docker; run as a user who may use both.

Usage: uv run python bench/bench_compose.py SIF DOCKER_IMAGE [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import tempfile
import time
from pathlib import Path

from harbor.environments.base import BaseEnvironment
from harbor.environments.docker.docker import DockerEnvironment
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

from harbor_hpc.containers.environment import SingularityEnvironment

COMPOSE = """\
services:
  main:
    depends_on:
      api: {{condition: service_healthy}}
  api:
    image: {image}
    command: ["python3", "-m", "http.server", "5000"]
    healthcheck:
      test: ["CMD", "python3", "-c", "import socket; socket.create_connection(('localhost', 5000))"]
      interval: 0.2s
      start_period: 0s
      retries: 100
"""


def make(kind: str, image: str, folder: Path, with_service: bool) -> BaseEnvironment:
    env_dir = folder / "environment"
    env_dir.mkdir(parents=True)
    if with_service:
        (env_dir / "docker-compose.yaml").write_text(COMPOSE.format(image=image))
    paths = TrialPaths(folder / "trial")
    paths.mkdir()
    cls: type[BaseEnvironment] = SingularityEnvironment if kind == "here" else DockerEnvironment
    return cls(
        environment_dir=env_dir,
        environment_name="bench",
        session_id=f"bench-{folder.name}__env",
        trial_paths=paths,
        task_env_config=EnvironmentConfig(docker_image=image),
        logger=logging.getLogger("bench"),
    )


async def measure(environment: BaseEnvironment, with_service: bool) -> dict[str, float]:
    began = time.perf_counter()
    await environment.start(force_build=False)
    figures = {"start s": time.perf_counter() - began}
    try:
        began = time.perf_counter()
        if with_service:
            result = await environment.service_exec("true", service="api")
        else:
            result = await environment.exec("true")
        assert result.return_code == 0, result
        figures["exec ms"] = (time.perf_counter() - began) * 1000
    finally:
        began = time.perf_counter()
        await environment.stop(delete=True)
        figures["stop s"] = time.perf_counter() - began
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sif", type=Path)
    parser.add_argument("docker_image")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    images = {"here": str(args.sif.resolve()), "docker": args.docker_image}
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-compose-") as tmp:
        for round_ in range(args.rounds):
            # Interleaved, so that a busy moment of the machine touches every variant alike.
            for kind in ("here", "docker"):
                for with_service in (False, True):
                    folder = Path(tmp) / f"{kind}-{with_service}-{round_}"
                    environment = make(kind, images[kind], folder, with_service)
                    figures = asyncio.run(measure(environment, with_service))
                    results.setdefault((kind, with_service), []).append(figures)

    def median(kind: str, with_service: bool, key: str) -> float:
        return statistics.median(f[key] for f in results[(kind, with_service)])

    print(f"{'variant':34} {'start s':>8} {'exec ms':>8} {'stop s':>7}")
    for kind, label in (("here", "harbor-hpc (Apptainer pod)"), ("docker", "Harbor Docker")):
        for with_service in (False, True):
            name = f"{label}, {'+ 1 service' if with_service else 'task alone'}"
            print(
                f"{name:34} {median(kind, with_service, 'start s'):8.2f} "
                f"{median(kind, with_service, 'exec ms'):8.1f} "
                f"{median(kind, with_service, 'stop s'):7.2f}"
            )
    for key in ("start s", "stop s"):
        ours, docker = median("here", True, key), median("docker", True, key)
        print(f"with a service, {key.split()[0]}: harbor-hpc / Docker = {ours / docker:.2g}")
    extra_ours = median("here", True, "start s") - median("here", False, "start s")
    extra_docker = median("docker", True, "start s") - median("docker", False, "start s")
    print(f"what the service adds to start: here {extra_ours:.2f} s, Docker {extra_docker:.2f} s")


if __name__ == "__main__":
    main()
