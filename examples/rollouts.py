"""A trainer's side of harbor-hpc: N rollouts of terminus-2 per task, tokens back in Python.

    python examples/rollouts.py TASKS RUN_DIR --api-base http://HOST:8000/v1 \
        --model openai/policy --attempts 8 --concurrency 4 --deadline 1800

Point `--api-base` at the policy's OpenAI-compatible server (vLLM returns each call's token ids
and log-probs when asked; terminus-2 asks, since harbor-hpc turns `collect_rollout_details` on).
The server is asked once before anything runs: a wrong URL, model or key ends this at once,
with what to fix. The trials run in harbor-hpc's Apptainer environment as local processes here
(`--executor slurm` sends them to Slurm instead); the API key, if the server wants one, goes by
name: set OPENAI_API_KEY in this environment.

Each rollout prints as one line as soon as it ends (task, reward, trainable, how many tokens the
policy produced of how many in its sequences); progress goes to stderr. At the end each task's
group of attempts is used whole, or masked whole when one of its members is not trainable (the
infrastructure, the model server or the deadline failed it), as GRPO-style trainers (SkyRL) do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from harbor_hpc.api import HarborHpcError, Progress, RolloutRequest, stream_rollouts


def show_progress(progress: Progress) -> None:
    print(
        f"[rollouts] {progress.done} done, {progress.failed} failed, {progress.running} "
        f"running, {progress.pending} pending of {progress.total}",
        file=sys.stderr,
        flush=True,
    )


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("tasks", type=Path)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--api-base", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--attempts", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--executor", default="local")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the batch")
    args = parser.parse_args()

    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    try:
        request = RolloutRequest(
            tasks=args.tasks,
            run_dir=args.run_dir,
            agent="terminus-2",
            model=args.model,
            # terminus-2 records an asciinema cast of its terminal unless told not to: most
            # images have no asciinema, and a trainer has no use for the cast.
            agent_kwargs={"api_base": args.api_base, "record_terminal_session": False},
            agent_env=["OPENAI_API_KEY"] if "OPENAI_API_KEY" in os.environ else [],
            attempts=args.attempts,
            concurrency=args.concurrency,
            executor=args.executor,
            deadline_s=args.deadline,
        )
        async with contextlib.aclosing(stream_rollouts(request, progress=show_progress)) as lines:
            async for line in lines:
                groups[line["task"]].append(line)
                mask = line["mask_ids"] or []
                print(
                    f"{line['task']} #{line['attempt']}: reward={line['reward']} "
                    f"trainable={line['trainable']} policy_tokens={sum(mask)}/{len(mask)}",
                    flush=True,
                )
    except HarborHpcError as exc:  # a wrong setting, named before anything ran
        print(f"error: {exc.message}" + (f" ({exc.hint})" if exc.hint else ""), file=sys.stderr)
        return exc.exit_code
    for task, group in sorted(groups.items()):
        # The line of the group's last attempt to end carries the group's final verdict.
        used = group[-1]["group_trainable"] is True
        print(f"group {task}: {len(group)} rollouts, {'used' if used else 'masked'}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
