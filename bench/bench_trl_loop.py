"""A TRL-like loop of rollouts on each kind of sandbox, side by side in one run.

What GRPOTrainer (trl 1.16) does with `environment_factory` in one step, here without a model:
`--rollouts` environments (`--tasks` tasks, each `--group` times in a row, as its sampler
repeats a prompt) are reset one after another, then each gets three `bash` tool calls (one
round over all of them at a time, the last writing the answer: right for every other rollout),
then `get_reward` (TRL's `env.reward` for TRL's own class), one after another. `--think`
seconds between the resets and the first round stand for the model's first turn.

Variants, interleaved round by round (the machine is shared):
- `ours`: harbor_hpc.trl.HarborBashEnv, `ahead` = group - 1 (the pool);
- `ours-ray`: the same with executor ray, on a `harbor-hpc ray up` cluster (`--ray`);
- `import-path`: TRL's own HarborBashEnv with its `_start` building Harbor's environment from
  our import path (the 20-line subclass a user could write: no pool, each reset a start);
- `harbor-singularity`: TRL's own HarborBashEnv with `environment_type="singularity"`
  (Harbor's own Singularity environment: what TRL gives without us), `--harbor-rollouts` of
  them (its starts are slow);
- `one start`: one reset and its first tool call on a fresh pool of ours, `--starts` times.

For each: the resets, the first round (which waits for the starts), the whole loop, and how
many rewards were right. Goal (issue 56): the pool's resets plus its first round cost at most
two starts.

Usage: PYTHONPATH=<trl 1.16> uv run --extra ray python bench/bench_trl_loop.py
           [--rollouts 64] [--tasks 8] [--rounds 1] [--think 0] [--ray]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_environment import add_image_arguments, server_sif

from tests.support.sample_tasks import make_task


@dataclass
class Loop:
    resets: float
    first_round: float
    total: float
    right: int
    rollouts: int

    def row(self, name: str) -> str:
        return (
            f"{name:<20} {self.rollouts:>4} {self.resets:>8.2f} {self.first_round:>9.2f} "
            f"{self.total:>8.2f} {self.total / self.rollouts:>8.3f} {self.right:>4}/{self.rollouts}"
        )


def trls_own(cls: type) -> type:
    """TRL's class, its sandbox stopped by `run_loop`: its own __del__ waits forever on a loop
    that has stopped when the interpreter exits."""

    class Stopped(cls):  # type: ignore[misc,valid-type,unused-ignore]
        def __del__(self) -> None:
            pass

    return Stopped


def import_path_env() -> type:
    """TRL's HarborBashEnv whose sandbox is our environment by import path, as a user could
    subclass it without harbor_hpc.trl."""
    from trl.experimental.harbor import HarborBashEnv

    class ImportPathEnv(HarborBashEnv):  # type: ignore[misc,unused-ignore]
        async def _start(self, task_dir: str) -> str:
            from harbor.environments.factory import EnvironmentFactory
            from harbor.models.task.task import Task
            from harbor.models.trial.config import EnvironmentConfig
            from harbor.models.trial.paths import TrialPaths

            await self._stop()
            task = Task(task_dir=Path(task_dir))
            paths = TrialPaths(trial_dir=Path(tempfile.mkdtemp(prefix="harbor_trl_")))
            paths.mkdir()
            environment = EnvironmentFactory.create_environment_from_config(
                config=EnvironmentConfig(
                    import_path="harbor_hpc.environment:SingularityEnvironment"
                ),
                environment_dir=task.paths.environment_dir,
                environment_name=task.short_name,
                session_id=uuid.uuid4().hex,
                trial_paths=paths,
                task_env_config=task.config.environment,
            )
            self._task, self._paths, self._env = task, paths, environment
            await environment.start(force_build=False)
            await environment.exec("mkdir -p /workdir /home/user/input")
            return str(task.instruction)

    return trls_own(ImportPathEnv)


def run_loop(factory: Callable[[], Any], tasks: list[Path], group: int, think: float) -> Loop:
    order = [task for task in tasks for _ in range(group)]
    envs = [factory() for _ in order]
    began = time.perf_counter()
    for env, task in zip(envs, order, strict=True):
        env.reset(task_dir=str(task))
    resets = time.perf_counter() - began
    time.sleep(think)
    first = time.perf_counter()
    for env in envs:
        env.bash("ls / > /dev/null")
    first_round = time.perf_counter() - first
    for env in envs:
        env.bash("cat /etc/os-release > /dev/null")
    for i, env in enumerate(envs):
        env.bash(f"echo {42 if i % 2 == 0 else 7} > /tmp/answer")
    rewards = [env.get_reward() if hasattr(env, "get_reward") else env.reward for env in envs]
    for env in envs:
        if not hasattr(env, "get_reward"):  # TRL's own: stopped at its next reset, here now
            env._run(env._stop())
            env._loop.call_soon_threadsafe(env._loop.stop)
    total = time.perf_counter() - began  # ours stop in get_reward: both count the stops
    right = sum(reward == (1.0 if i % 2 == 0 else 0.0) for i, reward in enumerate(rewards))
    return Loop(resets, first_round, total - think, right, len(envs))


@contextmanager
def maybe_ray(args: argparse.Namespace) -> Iterator[Path | None]:
    if not args.ray:
        yield None
        return
    from bench_ray_fleet import ray_cluster

    with ray_cluster(args) as cluster_dir:
        yield Path(cluster_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--tasks", type=int, default=8, help="tasks; each rollouts/tasks times")
    parser.add_argument("--harbor-rollouts", type=int, default=8, help="0: not Harbor's")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--think", type=float, default=0.0, help="s between resets and tools")
    parser.add_argument("--starts", type=int, default=5, help="single starts timed")
    parser.add_argument("--ray", action="store_true", help="also on a `ray up` cluster")
    # A GRPO batch's sandboxes live at once: on Ray they must all fit (else they wait, saying
    # so, until ray_placement_timeout_sec): 64 of 0.02 CPU and 64 MB fit the one node of the
    # site's default memory here (5.4 GB).
    parser.add_argument("--ray-cpus", type=float, default=0.02)
    parser.add_argument("--memory-mb", type=int, default=64, help="each task's memory_mb")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--ray-nodes-per-node", type=int, default=1)
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--ray-minutes", type=int, default=30)
    parser.add_argument("--partition", default=None)
    add_image_arguments(parser)
    args = parser.parse_args(argv)

    from trl.experimental.harbor import HarborBashEnv as TrlBash

    from harbor_hpc.sandbox.pool import SandboxOptions, SandboxPool
    from harbor_hpc.trl import HarborBashEnv

    sif = server_sif(args)
    if sif is None:
        return 2
    group = max(1, args.rollouts // args.tasks)
    work = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    tasks = [
        make_task(work / "tasks", f"t{i}", image=str(sif), memory_mb=args.memory_mb)
        for i in range(args.tasks)
    ]
    print(f"{args.rollouts} rollouts: {args.tasks} tasks x {group}, think {args.think:g} s")
    with maybe_ray(args) if args.ray else nullcontext(None) as cluster_dir:
        variants: dict[str, tuple[Callable[[], Any], list[Path], int]] = {
            "ours": (functools.partial(HarborBashEnv, ahead=group - 1), tasks, group),
            "import-path": (import_path_env(), tasks, group),
        }
        if args.harbor_rollouts > 0:
            # Harbor's own server takes some 80 MB: its tasks get 512 MB.
            roomy = [
                make_task(work / "roomy", f"t{i}", image=str(sif), memory_mb=512)
                for i in range(max(1, args.harbor_rollouts // group))
            ]
            variants["harbor-singularity"] = (
                functools.partial(trls_own(TrlBash), environment_type="singularity"),
                roomy,
                min(group, args.harbor_rollouts),
            )
        if cluster_dir is not None:
            variants["ours-ray"] = (
                functools.partial(
                    HarborBashEnv,
                    executor="ray",
                    ahead=group - 1,
                    environment_kwargs={"ray_cluster_dir": str(cluster_dir),
                                        "ray_cpus": args.ray_cpus},
                ),
                tasks,
                group,
            )  # fmt: skip
        results: dict[str, list[Loop]] = {name: [] for name in variants}
        starts: list[float] = []
        for _ in range(args.rounds):
            for name, (factory, some, size) in variants.items():
                results[name].append(run_loop(factory, some, size, args.think))
                print(results[name][-1].row(name), flush=True)
            for _ in range(args.starts):
                with SandboxPool(SandboxOptions()) as pool:
                    began = time.perf_counter()
                    sandbox = pool.open(tasks[0])
                    sandbox.exec("ls / > /dev/null")
                    starts.append(time.perf_counter() - began)
                    sandbox.close()
    start = statistics.median(starts)
    print(f"\none start (reset + first tool call, fresh pool): median {start:.2f} s "
          f"of {len(starts)} ({min(starts):.2f}-{max(starts):.2f})")  # fmt: skip
    print(f"{'variant':<20} {'n':>4} {'resets':>8} {'1st round':>9} {'total':>8} "
          f"{'s/rollout':>8} right")  # fmt: skip
    for name, loops in results.items():
        best = min(loops, key=lambda loop: loop.total)
        print(
            best.row(name)
            + f"   resets+1st round = {(best.resets + best.first_round) / start:.1f} starts"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
