"""What a policy's acts on its own container come to: Harbor's Docker environment beside ours.

The terminus-2 fault matrix of tests/e2e/test_policy_acts.py (its ACTS, one scripted policy per
task, named by `[fault:ACT]` in the instruction, against the scripted model server), plus
`shm`: 400 MB written into /dev/shm with memory_mb 256 (Docker's /dev/shm is a 64 MB tmpfs of
its own). Each act once per side, interleaved, through `harbor trial start -a terminus-2`:

  docker      `-e docker` (Compose v2): the task built from `environment/Dockerfile`
              (`FROM BASE`, no docker_image), Harbor's memory_mb as the container's mem_limit.
  harbor-hpc  `-e harbor_hpc.environment:SingularityEnvironment` on SIF (the task's
              docker_image), as --as-user (runuser; needs root) or the current user.

Then one table: per act and side, the exception Harbor recorded, the reward, and the class and
trainable of the validity rule (`harbor_hpc.results.classify`, on the trial's result.json and
what its folder says). No figure is asserted: an act that fails is a row, not an error.

Needs Docker Engine with Compose v2 and BASE in Docker; Apptainer; run as a user who may use
both, e.g. as root, ours as an ordinary user:
  uv run python bench/bench_policy_acts.py /work/exp/debian.sif --as-user hpcuser
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harbor_hpc.results.classify import outcome_of_trial
from tests.e2e.test_policy_acts import ACTS, acting
from tests.e2e.test_terminus2 import ENVIRONMENT, turn
from tests.support.sample_tasks import make_task
from tests.support.scripted_llm import ScriptedLLM

HARBOR = str(Path(sys.executable).with_name("harbor"))
TRIAL_TIMEOUT_SEC = 900

# act: (the policy's command, the seconds it waits for it, the task's memory_mb)
BENCH_ACTS: dict[str, tuple[str, float, int]] = {
    **{
        act: (command, seconds, memory_mb) for act, (command, seconds, memory_mb, _) in ACTS.items()
    },
    "shm": ("head -c 400000000 /dev/zero > /dev/shm/big; echo 42 > /tmp/answer\n", 5, 256),
}


@dataclass
class Side:
    """What one side made of one act."""

    exception: str | None = None
    reward: float | None = None
    failure: str | None = None
    trainable: bool | None = None
    message: str | None = None
    seconds: float = 0.0


def as_user(command: list[str], user: str | None) -> list[str]:
    """`command` run as `user`: unchanged for the current user, through runuser when root."""
    if user is None or user == getpass.getuser():
        return command
    if os.geteuid() != 0:
        sys.exit(f"--as-user {user} needs root (runuser); run as {user} instead")
    home = pwd.getpwnam(user).pw_dir
    return ["runuser", "-u", user, "--", "env", f"HOME={home}", f"USER={user}", *command]


def make_tasks(root: Path, side: str, image: str | None) -> dict[str, Path]:
    tasks = {}
    for act, (_, _, memory_mb) in BENCH_ACTS.items():
        task = make_task(root / side, act, image=image, memory_mb=memory_mb)
        (task / "instruction.md").write_text(f"Write 42 into /tmp/answer. [fault:{act}]\n")
        tasks[act] = task
    return tasks


def trial(task: Path, trials: Path, environment: str, llm: ScriptedLLM, user: str | None) -> Side:
    trials.mkdir(parents=True, exist_ok=True)
    if user is not None and user != getpass.getuser():
        shutil.chown(trials, user)
    command = [
        "env", "OPENAI_API_KEY=scripted-bench-key", "LITELLM_LOCAL_MODEL_COST_MAP=True",
        HARBOR, "trial", "start", "-p", str(task), "-a", "terminus-2",
        "-m", f"openai/{llm.model}", "--agent-kwarg", f"api_base={llm.url}",
        "--agent-kwarg", "collect_rollout_details=true",
        "--agent-kwarg", "record_terminal_session=false",
        "-e", environment, "--trials-dir", str(trials),
    ]  # fmt: skip
    began = time.perf_counter()
    try:
        done = subprocess.run(
            as_user(command, user),
            cwd=trials,
            capture_output=True,
            text=True,
            timeout=TRIAL_TIMEOUT_SEC,
            check=False,
        )
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        output = f"timed out after {TRIAL_TIMEOUT_SEC} s"
    seconds = time.perf_counter() - began
    (trials / "harbor.log").write_text(output)
    results = sorted(trials.glob("*/result.json"))
    if not results:
        return Side(exception="no result.json", message=output.strip()[-300:], seconds=seconds)
    data = json.loads(results[-1].read_text())
    outcome = outcome_of_trial(results[-1].parent, data, reward_key=None)
    info = data.get("exception_info") or {}
    return Side(
        exception=info.get("exception_type"),
        reward=outcome.reward,
        failure=outcome.failure,
        trainable=outcome.trainable,
        message=outcome.message,
        seconds=seconds,
    )


def cell(side: Side) -> str:
    reward = "-" if side.reward is None else f"{side.reward:g}"
    failure = side.failure or "ok"
    return f"{side.exception or '-'}, {reward}, {failure}, {'yes' if side.trainable else 'no'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sif", type=Path, help="the .sif of BASE, for our side")
    parser.add_argument("--base", default="local/debian:bookworm", help="Docker's base image")
    parser.add_argument("--as-user", help="run our side as this user (runuser; needs root)")
    parser.add_argument("--acts", nargs="*", choices=list(BENCH_ACTS), default=list(BENCH_ACTS))
    parser.add_argument("--keep", type=Path, help="keep tasks and trials in this folder")
    args = parser.parse_args()
    user = args.as_user or getpass.getuser()
    work = Path(args.keep or tempfile.mkdtemp(prefix="bench-acts-"))
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)
    docker_tasks = make_tasks(work / "tasks", "docker", None)
    for task in docker_tasks.values():
        (task / "environment" / "Dockerfile").write_text(f"FROM {args.base}\n")
    hpc_tasks = make_tasks(work / "tasks", "hpc", str(args.sif.resolve()))
    faults = {act: acting(command, seconds) for act, (command, seconds, _) in BENCH_ACTS.items()}
    rows: dict[str, dict[str, Side]] = {}
    print(f"docker as {getpass.getuser()}, harbor-hpc as {user}; trials in {work}", flush=True)
    with ScriptedLLM([turn([], done=True)], faults=faults) as llm:
        # Interleaved, so that a busy moment of the machine touches both sides alike.
        for act in args.acts:
            rows[act] = {
                "docker": trial(docker_tasks[act], work / "trials" / "docker" / act, "docker",
                                llm, None),
                "hpc": trial(hpc_tasks[act], work / "trials" / "hpc" / act, ENVIRONMENT,
                             llm, args.as_user),
            }  # fmt: skip
            for name, side in rows[act].items():
                print(f"  {act:14s} {name:7s} {cell(side)}  ({side.seconds:.0f} s)", flush=True)

    print("\nper side: exception, reward, class (ok: the policy's outcome), trainable")
    print(f"{'act':14s} | {'Harbor Docker':44s} | harbor-hpc")
    for act, sides in rows.items():
        print(f"{act:14s} | {cell(sides['docker']):44s} | {cell(sides['hpc'])}")
    for act, sides in rows.items():
        for name, side in sides.items():
            if side.message:
                print(f"{act} {name}: {' '.join(side.message.split())[:240]}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
