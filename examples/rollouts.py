"""A trainer's side of harbor-hpc: N rollouts of terminus-2 per task, tokens back in Python.

    python examples/rollouts.py TASKS RUN_DIR --api-base http://HOST:8000/v1 \
        --model openai/policy --attempts 8 --concurrency 4

Point `--api-base` at the policy's OpenAI-compatible server (vLLM returns each call's token ids
and log-probs when asked; terminus-2 asks, since harbor-hpc turns `collect_rollout_details` on).
The trials run in harbor-hpc's Apptainer environment as local processes here (`--executor slurm`
sends them to Slurm instead); the API key, if the server wants one, goes by name: set
OPENAI_API_KEY in this environment. Each rollout prints as one line: task, reward, trainable,
and how many tokens the policy produced (mask 1) of how many in its sequences.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from harbor_hpc.api import RolloutRequest, run_rollouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tasks", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--api-base", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--attempts", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--executor", default="local")
    args = parser.parse_args()

    lines = run_rollouts(
        RolloutRequest(
            tasks=args.tasks,
            run_dir=args.run_dir,
            agent="terminus-2",
            model=args.model,
            agent_kwargs={"api_base": args.api_base, "record_terminal_session": False},
            agent_env=["OPENAI_API_KEY"] if "OPENAI_API_KEY" in os.environ else [],
            attempts=args.attempts,
            concurrency=args.concurrency,
            executor=args.executor,
        )
    )
    for line in lines:
        mask = line.get("mask_ids") or []
        print(
            f"{line['task']} #{line['attempt']}: reward={line['reward']} "
            f"trainable={line['trainable']} policy_tokens={sum(mask)}/{len(mask)}"
        )


if __name__ == "__main__":
    main()
