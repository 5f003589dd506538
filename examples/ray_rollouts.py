"""A trainer's side on Ray: N rollouts of terminus-2 in one process, their containers on CPU nodes.

    harbor-hpc ray up --nodes 2 --partition cpu --time 240
    python examples/ray_rollouts.py TASK TRIALS_DIR --api-base http://HOST:8000/v1 \
        --model openai/policy --rollouts 8

An online RL trainer holds its GPU nodes and runs one asyncio loop; here each rollout is one of
Harbor's own trials (`harbor.trial.trial.Trial`) on that loop, all at once. The agent runs in
this process (terminus-2 calls the policy's OpenAI-compatible server, asking for token ids and
log-probs), its container on a node of the Ray cluster `ray up` started, through
`harbor_hpc.environment:RaySingularityEnvironment`: Ray places each environment where its
`--ray-cpus` are free, and holds the rest back until they are. The task folder and its image must
be on a filesystem the Ray nodes share. The API key is read from OPENAI_API_KEY: litellm wants
one even when the server checks none (any value does then). Each rollout prints as one line:
task, trial, the node its container ran on, reward, trainable, and how many tokens the policy
produced (mask 1) of how many in its sequences, from the same rollout record `harbor-hpc export`
writes; a rollout that failed adds its failure class and message, and the example then exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from harbor.models.trial.config import (
    AgentConfig,
    EnvironmentConfig,
    TaskConfig,
    TrialConfig,
)
from harbor.trial.trial import Trial

from harbor_hpc.api import error_policy_overrides, recording_calls, trial_rollout

ENVIRONMENT = "harbor_hpc.environment:RaySingularityEnvironment"


async def run_trial(config: TrialConfig) -> tuple[Path, str]:
    """One rollout: its trial folder and the node its container ran on (address and Ray node
    id)."""
    trial = await Trial.create(config)
    # Each model call of the agent, kept in the trial's folder: the evidence `trial_rollout`
    # needs to tell a hung or slow policy server from the policy itself (never trainable).
    with recording_calls(trial.paths.trial_dir):
        await trial.run()
    environment = trial.agent_environment
    return trial.paths.trial_dir, f"{environment.node} node_id={environment.node_id}"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", type=Path)
    parser.add_argument("trials_dir", type=Path)
    parser.add_argument("--api-base", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("--ray-cpus", type=float, help="CPUs per environment [the task's]")
    parser.add_argument("--ray-cluster-dir", type=Path, help="ray up's --cluster-dir")
    args = parser.parse_args()
    task = args.task.resolve()
    # The trials hold what the agent was given and what it earned: yours alone (Harbor opens
    # each trial's own folder to everyone).
    args.trials_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    agent_kwargs = {
        "api_base": args.api_base,
        "collect_rollout_details": True,  # token ids and log-probs, per model call
        "record_terminal_session": False,  # no asciinema in the image
    }
    environment_kwargs: dict[str, Any] = {}
    if args.ray_cpus is not None:
        environment_kwargs["ray_cpus"] = args.ray_cpus
    if args.ray_cluster_dir is not None:
        environment_kwargs["ray_cluster_dir"] = str(args.ray_cluster_dir)
    # One config per rollout: Harbor names each trial when its config is made.
    configs = [
        TrialConfig(
            task=TaskConfig(path=task),
            trials_dir=args.trials_dir,
            agent=AgentConfig(name="terminus-2", model_name=args.model, kwargs=agent_kwargs),
            environment=EnvironmentConfig(import_path=ENVIRONMENT, kwargs=environment_kwargs),
            # Harbor's error policy then knows our environment's failures (never trainable).
            override_error_policy=error_policy_overrides(),
        )
        for _ in range(args.rollouts)
    ]
    ended = await asyncio.gather(*(run_trial(c) for c in configs))

    # Each rollout as `export` writes it (policy tokens, reward, failure class).
    failed = 0
    for attempt, (trial_dir, node) in enumerate(ended):
        line = trial_rollout(trial_dir, task, attempt=attempt)
        mask = line["mask_ids"] or []
        failure = f" failed={line['failure']}: {line['message']}" if line["failure"] else ""
        failed += line["failure"] is not None
        print(
            f"{task.name} #{attempt}: trial={trial_dir.name} node={node} "
            f"reward={line['reward']} trainable={line['trainable']} "
            f"policy_tokens={sum(mask)}/{len(mask)}{failure}",
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
