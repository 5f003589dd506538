"""Small Harbor tasks for the Slurm tests and the submit benchmark, each a known outcome.

The oracle agent runs solution/solve.sh and tests/test.sh writes the reward, so every kind of
task below ends in a foreseeable way: solved (reward 1), unsolved (reward 0), solved after a
while, over its memory (the watchdog's `memory`), over its agent time (`timeout`), or without
an image (`image`).
"""

from __future__ import annotations

from pathlib import Path

# The test passes when solve.sh left the answer where the instruction asks for it.
_TEST = """#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /tmp/answer 2>/dev/null)" = "42" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""

# Fetches the answer from the `answers` service (answer_service).
FETCH_ANSWER = (
    'python3 -c "import urllib.request as u; '
    "print(u.urlopen('http://answers:8000/answer').read().decode().strip())\" > /tmp/answer\n"
)

SOLVE = {
    "solved": "echo 42 > /tmp/answer\n",
    "unsolved": "echo 41 > /tmp/answer\n",
    # Grows a Python list well past any small memory_mb, slowly enough for a watchdog to see:
    # the python3 is killed (as Docker's OOM killer kills it) and the task goes on, solved.
    "memory_hog": (
        "python3 -c 'import time\nb=[]\nfor _ in range(400):\n"
        "    b.append(bytearray(8 << 20)); time.sleep(0.02)\ntime.sleep(30)'\n"
        "echo 42 > /tmp/answer\n"
    ),
    # Fills the container's /dev and /dev/shm (tmpfs mounts of Docker's 64 MB each: RAM no
    # process is charged for, which no kill frees) past a memory_mb under 128: the container
    # is killed (`memory`).
    "dev_hog": (
        "head -c 70000000 /dev/zero > /dev/big; head -c 70000000 /dev/zero > /dev/shm/big\n"
        "sleep 30\necho 42 > /tmp/answer\n"
    ),
    "slow": "sleep 600\necho 42 > /tmp/answer\n",
    # Solves, but takes long enough to be caught running (and cancelled) by a test, however
    # slowly its container starts; the test then makes it a solved task for the rerun.
    "sleepy": "sleep 60\necho 42 > /tmp/answer\n",
    # Solves after a pause long enough for a test to crash the node it runs on.
    "lingering": "sleep 25\necho 42 > /tmp/answer\n",
    # Solves after a pause in which a test can do something to the run (fill its disk).
    "pausing": "sleep 8\necho 42 > /tmp/answer\n",
    # The same, saying first in its /tmp (on the node's scratch disk) that it has started.
    "marks_then_pauses": "touch /tmp/started\nsleep 8\necho 42 > /tmp/answer\n",
    # Solves only when the agent was given the secret its run passed with --agent-env.
    "secret": '[ "$HH_TEST_SECRET" = s3cr3t-2f9a ] && echo 42 > /tmp/answer\n',
    # Solves by renaming a new directory into an image's folder, as dpkg installs one (which
    # Apptainer's own overlay over a folder refuses: EXDEV).
    "renames_a_directory": (
        "mkdir /usr/share/answer.dpkg-new && python3 -c 'import os; "
        'os.rename("/usr/share/answer.dpkg-new", "/usr/share/answer")\' && echo 42 > /tmp/answer\n'
    ),
    # Solves only where the compose service `answers` (answer_service) is reachable by name.
    "from_service": FETCH_ANSWER,
    # Solves only when it was given exactly one GPU (of the devices Slurm gave its job); notes
    # how opening each fake GPU device file in its /dev ends (ENXIO: allowed, no driver; EPERM:
    # refused by the job's device cgroup).
    "one_gpu": (
        'python3 -c \'import glob, os\nfor path in sorted(glob.glob("/dev/harbor-hpc-gpu*")):\n'
        '    try:\n        os.close(os.open(path, os.O_RDONLY)); said = "opened"\n'
        "    except OSError as error:\n        said = os.strerror(error.errno)\n"
        "    print(path, said)' > /logs/agent/devices\n"
        'echo "$CUDA_VISIBLE_DEVICES" > /logs/agent/gpus\n'
        'one="${CUDA_VISIBLE_DEVICES#*,}"\n'
        '[ -n "$CUDA_VISIBLE_DEVICES" ] && [ "$one" = "$CUDA_VISIBLE_DEVICES" ]'
        " && echo 42 > /tmp/answer\n"
    ),
}


def make_task(
    root: Path,
    name: str,
    *,
    kind: str = "solved",
    image: str | None,
    memory_mb: int = 512,
    agent_timeout_sec: float = 60,
    verifier_timeout_sec: float = 60,
    gpus: int = 0,
    gpu_types: list[str] | None = None,
    compose: str | None = None,
) -> Path:
    """Write the task `root/name` of `kind` (a key of SOLVE) running in `image`."""
    task = root / name
    (task / "solution").mkdir(parents=True, exist_ok=True)
    (task / "tests").mkdir(exist_ok=True)
    (task / "environment").mkdir(exist_ok=True)
    image_line = f'docker_image = "{image}"\n' if image else ""
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n\n'
        f"[agent]\ntimeout_sec = {agent_timeout_sec}\n\n"
        f"[verifier]\ntimeout_sec = {verifier_timeout_sec}\n\n"
        f"[environment]\n{image_line}memory_mb = {memory_mb}\ncpus = 1\n"
        + (f"gpus = {gpus}\n" if gpus else "")
        + (f"gpu_types = {gpu_types!r}\n".replace("'", '"') if gpu_types else "")
    )
    (task / "instruction.md").write_text("Write 42 into /tmp/answer.\n")
    (task / "environment" / "Dockerfile").write_text("FROM local/debian:bookworm\n")
    if compose is not None:
        (task / "environment" / "docker-compose.yaml").write_text(compose)
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + SOLVE[kind])
    (task / "tests" / "test.sh").write_text(_TEST)
    for script in (task / "solution" / "solve.sh", task / "tests" / "test.sh"):
        script.chmod(0o755)
    return task


def answer_service(image: str) -> str:
    """A compose file whose service `answers` (in `image`, python3 in it) serves the answer at
    http://answers:8000/answer once healthy; the task's container waits for that."""
    return f"""\
services:
  main:
    depends_on:
      answers:
        condition: service_healthy
  answers:
    image: {image}
    command:
      - sh
      - -c
      - mkdir -p /srv && echo 42 > /srv/answer && exec python3 -m http.server 8000 -d /srv
    healthcheck:
      test:
        - CMD
        - python3
        - -c
        - import socket; socket.create_connection(('localhost', 8000), 2)
      interval: 1s
      retries: 60
"""
