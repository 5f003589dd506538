"""The environment on the real Apptainer: oracle trials through Harbor's CLI, and its promises.

The session's .sif of the test base image (python3, `debian_sif`) is shared; an image
without python3 comes through the test registry as a reference, which also exercises the
conversion into the .sif store and the bash server. Both live in a world-readable folder
so that the other local user can run them too. The oracle trials run side by side, each
through Harbor's CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from harbor_hpc.containers.container import IMAGE_VIEW, server_mounts
from harbor_hpc.containers.environment import (
    SingularityEnvironment,
    container_hostname,
    exported_by_setup,
)
from harbor_hpc.containers.errors import ContainerStartFailed, ImageUnavailable, SetupScriptFailed
from harbor_hpc.containers.limits import AS_YOU, IN_MEMORY, ONE_ID, read_limits
from harbor_hpc.containers.probes import missing_subid_ranges, trial_scratch_finding
from harbor_hpc.containers.sif import (
    ImageConfig,
    foreign_architecture,
    image_config,
    node_architecture,
    root_partition,
)
from harbor_hpc.containers.store import ensure_sif
from harbor_hpc.containers.watchdog import process_tree
from harbor_hpc.core.probe import Status
from harbor_hpc.results.classify import outcome_of_trial
from harbor_hpc.runtimes.apptainer import apptainer_here, find_apptainer
from tests.support.environments import make_environment, started
from tests.support.processes import ENDED_WITHIN_S, container_processes, gone_within
from tests.support.users import other_user_command

HARBOR = str(Path(sys.executable).parent / "harbor")
ENVIRONMENT = "harbor_hpc.environment:SingularityEnvironment"
REWARD_TEST = """\
#!/bin/bash
if [ "$(cat /app/answer.txt)" = "{expected}" ]; then echo 1; else echo 0; fi \\
    > /logs/verifier/reward.txt
"""


# -- units that need no container ------------------------------------------------


def test_a_hostname_is_never_all_digits(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI drew 392880175286 once: `getent hosts $(hostname)` then finds nothing, as it would in
    # no Docker container (moby draws such an id again).
    ids = iter([uuid.UUID(int=0x3928801752860000 << 64), uuid.UUID(hex="ab" * 16)])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(ids))
    assert container_hostname() == "abababababab"


def test_exported_by_setup_keeps_new_and_changed_variables() -> None:
    before = b"PATH=/usr/bin\0HOME=/root\0SHLVL=1\0KEEP=same\0"
    after = b"PATH=/opt/venv/bin:/usr/bin\0HOME=/root\0SHLVL=2\0KEEP=same\0NEW=a=b\nc\0"
    assert exported_by_setup(before, after) == {
        "PATH": "/opt/venv/bin:/usr/bin",
        "NEW": "a=b\nc",
    }


def test_missing_sif_is_image_unavailable(tmp_path: Path) -> None:
    environment = make_environment(str(tmp_path / "gone.sif"), tmp_path)
    with pytest.raises(ImageUnavailable, match=r"gone\.sif does not exist"):
        asyncio.run(environment.start(force_build=False))


def test_preflight_names_the_missing_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither runtime here: `auto` names both; a runtime set names its own."""
    find_apptainer.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    for name in ("HARBOR_HPC_APPTAINER", "HARBOR_HPC_ENROOT", "HARBOR_HPC_RUNTIME"):
        monkeypatch.delenv(name, raising=False)
    try:
        both = "no container runtime here: neither Apptainer (apptainer, singularity) nor enroot"
        with pytest.raises(SystemExit, match=re.escape(both)):
            SingularityEnvironment.preflight()
        with pytest.raises(SystemExit, match="neither apptainer nor singularity is on PATH"):
            SingularityEnvironment.preflight({"runtime": "apptainer"})
        with pytest.raises(SystemExit, match="enroot is not on PATH"):
            SingularityEnvironment.preflight({"runtime": "enroot"})
    finally:
        find_apptainer.cache_clear()


def test_workdir_kwarg_wins(tmp_path: Path) -> None:
    assert make_environment("x.sif", tmp_path, workdir="/w").workdir == "/w"


# -- shared images ------------------------------------------------------------------


@pytest.fixture(scope="session")
def nopython_ref(slim_image: str) -> Iterator[str]:
    """An image without python3, pushed to the open test registry under a fresh tag."""
    import docker

    client = docker.from_env()
    image = client.images.get(slim_image)
    repository = f"{os.environ['HARBOR_HPC_TEST_REGISTRY']}/harbor-hpc-test/nopython"
    tag = uuid.uuid4().hex[:12]
    image.tag(repository, tag=tag)
    for line in client.images.push(repository, tag=tag, stream=True, decode=True):
        if "error" in line:
            raise RuntimeError(line["error"])
    yield f"{repository}:{tag}"
    client.images.remove(f"{repository}:{tag}")
    client.close()


@pytest.fixture(scope="session")
def sif_store(shared_dir: Path) -> Path:
    store = shared_dir / "store"
    store.mkdir(mode=0o755)
    return store


@pytest.fixture(scope="session")
def nopython_sif(nopython_ref: str, sif_store: Path) -> Path:
    sif = ensure_sif(nopython_ref, sif_store, nohttps=True)
    sif.chmod(0o755)
    return sif


# -- tasks and trials through Harbor's CLI ---------------------------------------


def make_task(
    root: Path,
    image: str,
    solve: str,
    *,
    expected: str = "42",
    memory_mb: int | None = None,
    files: dict[str, str] | None = None,
    verifier_timeout_sec: float = 60.0,
    test: str | None = None,
) -> Path:
    task = root / f"task-{uuid.uuid4().hex[:8]}"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True)
    memory = f"memory_mb = {memory_mb}\n" if memory_mb else ""
    (task / "task.toml").write_text(
        'version = "1.0"\n[agent]\ntimeout_sec = 120.0\n'
        f"[verifier]\ntimeout_sec = {verifier_timeout_sec}\n"
        f'[environment]\ndocker_image = "{image}"\nworkdir = "/app"\n{memory}'
    )
    (task / "instruction.md").write_text("Write the answer to /app/answer.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM scratch\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\n" + textwrap.dedent(solve))
    (task / "tests" / "test.sh").write_text(test or REWARD_TEST.format(expected=expected))
    for name, text in (files or {}).items():
        path = task / "environment" / "files" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return task


def start_trial(
    task: Path, trials: Path, *kwargs: str, environment: str = ENVIRONMENT
) -> subprocess.Popen[str]:
    """`harbor trial start` of `task` with the oracle agent, in the background."""
    command = [HARBOR, "trial", "start", "-p", str(task), "-a", "oracle", "-e", environment]
    for kwarg in kwargs:
        command += ["--environment-kwarg", kwarg]
    command += ["--trials-dir", str(trials)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def trial_result(task: Path, trials: Path, trial: subprocess.Popen[str]) -> dict[str, Any]:
    """The result.json of the trial of `task` that `trial` runs, once it ended."""
    stdout, stderr = trial.communicate(timeout=600)
    results = list(trials.glob(f"{task.name}__*/result.json"))
    assert results, f"no result.json:\n{stdout}\n{stderr}"
    result: dict[str, Any] = json.loads(results[0].read_text())
    return result


def run_trial(task: Path, trials: Path, *kwargs: str) -> dict[str, Any]:
    return trial_result(task, trials, start_trial(task, trials, *kwargs))


def reward(result: dict[str, Any]) -> float | None:
    verifier = result.get("verifier_result") or {}
    value = (verifier.get("rewards") or {}).get("reward")
    return None if value is None else float(value)


def still_running(pids: list[int]) -> list[str]:
    """The pids that still run, with who holds them (a zombie is dead, waiting to be reaped)."""
    running = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(f"{pid} {process.name()} (parent {process.ppid()})")
    return running


def host_pid(root: int, container_pid: int) -> int:
    """The host pid of the process that is `container_pid` in the container's pid namespace."""
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == str(container_pid):
                    return pid
    raise AssertionError(f"no process {container_pid} in the container under {root}")


@dataclass(frozen=True)
class OracleTrial:
    folder: Path  # the trial's folder under the trials dir
    result: dict[str, Any]


@pytest.fixture(scope="module")
def oracle_trials(
    debian_sif: Path, nopython_ref: str, sif_store: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, OracleTrial]:
    """Oracle trials through Harbor's CLI, one `harbor trial start` each as users run them, all
    at once: their start-ups, containers and the registry image's conversion overlap instead of
    queueing. Keyed by the test that reads each."""
    root = tmp_path_factory.mktemp("oracle")
    solve = "echo 42 > answer.txt\n"
    seeded = '[ "$HARBOR_STAGING" = /staging/env_files ] && cat "$SEED_FILE" > answer.txt\n'
    setup = 'cp "$HARBOR_STAGING/seed.txt" /opt/seed.txt\nexport SEED_FILE=/opt/seed.txt\n'
    failing = "echo 'cannot find the dataset' >&2\nexit 3\n"
    from_store = (f"singularity_image_cache_dir={sif_store}", "nohttps=true")
    tasks: dict[str, tuple[Path, tuple[str, ...]]] = {
        "plain": (make_task(root, str(debian_sif), solve), ()),
        "setup": (
            make_task(
                root,
                str(debian_sif),
                seeded,
                expected="seeded value",
                files={"setup.sh": setup, "seed.txt": "seeded value\n"},
            ),
            (),
        ),
        "failing setup": (make_task(root, str(debian_sif), solve, files={"setup.sh": failing}), ()),
        "registry": (make_task(root, nopython_ref, solve), from_store),
        "unpacked root": (
            make_task(root, str(debian_sif), solve),
            ("unpacked_roots=2", f"scratch_dir={root / 'scratch'}"),
        ),
        "slow verifier": (
            make_task(
                root,
                str(debian_sif),
                solve,
                verifier_timeout_sec=2.0,
                test="#!/bin/bash\nsleep 30\necho 1 > /logs/verifier/reward.txt\n",
            ),
            (),
        ),
    }
    trials = root / "trials"
    running = {name: start_trial(task, trials, *kwargs) for name, (task, kwargs) in tasks.items()}
    done = {}
    for name, (task, _) in tasks.items():
        result = trial_result(task, trials, running[name])
        done[name] = OracleTrial(next(trials.glob(f"{task.name}__*")), result)
    return done


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_oracle_plain_task(oracle_trials: dict[str, OracleTrial], debian_sif: Path) -> None:
    trial = oracle_trials["plain"]
    assert trial.result["exception_info"] is None
    assert reward(trial.result) == 1.0
    # Root in the container, but what the trial left on the host is the user's.
    assert {path.stat().st_uid for path in trial.folder.rglob("*")} == {os.getuid()}
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_oracle_from_an_unpacked_root(oracle_trials: dict[str, OracleTrial]) -> None:
    """`--environment-kwarg unpacked_roots=...` through Harbor's CLI: the trial ran from the
    image unpacked in its scratch folder (without a subuid range, which the unpack needs to
    keep the image's owners, from the .sif)."""
    trial = oracle_trials["unpacked root"]
    assert trial.result["exception_info"] is None
    assert reward(trial.result) == 1.0
    roots = trial.folder.parent.parent / "scratch" / f"harbor-hpc-roots-{os.getuid()}"
    unpacked = [path.name for path in roots.iterdir() if path.is_dir()]
    assert bool(unpacked) == (not missing_subid_ranges())


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_oracle_with_environment_files_and_setup_script(
    oracle_trials: dict[str, OracleTrial],
) -> None:
    result = oracle_trials["setup"].result
    assert result["exception_info"] is None
    assert reward(result) == 1.0


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_failing_setup_script_fails_the_trial(oracle_trials: dict[str, OracleTrial]) -> None:
    result = oracle_trials["failing setup"].result
    info = result["exception_info"]
    assert info["exception_type"] == SetupScriptFailed.__name__
    assert "exited with 3" in info["exception_message"]
    assert "cannot find the dataset" in info["exception_message"]
    assert reward(result) is None


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_a_verifier_that_runs_out_of_time_is_the_verifiers(
    oracle_trials: dict[str, OracleTrial],
) -> None:
    """Its time is the task's, not the policy's: class verifier (never the agent's `timeout`),
    no reward, and a message that says which setting to raise."""
    trial = oracle_trials["slow verifier"]
    assert trial.result["exception_info"]["exception_type"] == "VerifierTimeoutError"
    outcome = outcome_of_trial(trial.folder, trial.result, reward_key=None)
    assert (outcome.failure, outcome.trainable, outcome.reward) == ("verifier", False, None)
    assert outcome.message is not None
    assert "tests/test.sh ran past its verifier timeout" in outcome.message, outcome.message
    assert "raise [verifier] timeout_sec in the task's task.toml" in outcome.message


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_oracle_from_registry_reference_without_python(
    oracle_trials: dict[str, OracleTrial], sif_store: Path
) -> None:
    result = oracle_trials["registry"].result
    assert result["exception_info"] is None
    assert reward(result) == 1.0
    assert list(sif_store.glob("*.sif"))  # converted into the store, which stop keeps


@pytest.mark.apptainer
@pytest.mark.docker
def test_memory_hog_is_killed_as_under_docker(debian_sif: Path, tmp_path: Path) -> None:
    """Over memory_mb, the task's biggest process is killed, as the kernel's OOM killer kills it
    in a Docker container's cgroup, and the task goes on to its reward (the policy's outcome);
    memory that no kill frees (files in the container's /dev, a tmpfs) ends the container, named
    `memory`; /dev/shm is Docker's 64 MB."""
    hog = """\
    python3 -c '
    chunks = []
    for _ in range(150):
        chunks.append(b"x" * (20 << 20))
    print("survived")
    '
    echo "python3 ended with $?" > /logs/agent/hog.txt
    echo 42 > answer.txt
    """
    task = make_task(tmp_path, str(debian_sif), hog, memory_mb=512)
    result = run_trial(task, tmp_path / "trials")
    assert result["exception_info"] is None, result["exception_info"]
    assert reward(result) == 1.0
    trial = tmp_path / "trials" / result["trial_name"]
    assert (trial / "agent" / "hog.txt").read_text() == "python3 ended with 137\n"
    log = (trial / "trial.log").read_text()
    assert "out of memory: killed process" in log and "memory limit of 512 MB" in log, log

    # /dev/shm and /dev hold at most Docker's 64 MB each, tmpfs mounts no kill empties.
    shm = "head -c 100000000 /dev/zero > /dev/shm/big; echo $? > /logs/agent/shm.txt\n"
    task = make_task(tmp_path, str(debian_sif), shm + "echo 42 > answer.txt\n", memory_mb=512)
    result = run_trial(task, tmp_path / "trials")
    assert (result["exception_info"], reward(result)) == (None, 1.0), result["exception_info"]
    trial = tmp_path / "trials" / result["trial_name"]
    assert (trial / "agent" / "shm.txt").read_text() == "1\n"  # No space left on device

    dev = (
        "head -c 100000000 /dev/zero > /dev/big; echo $? > /logs/agent/dev.txt\n"
        "head -c 100000000 /dev/zero > /dev/shm/big; sleep 30\necho 42 > answer.txt\n"
    )
    # 120 MB: the kill at 114 MB leaves the processes 50 MB beside a full /dev (its write fails
    # first), and none beside both full mounts (the container ends).
    task = make_task(tmp_path, str(debian_sif), dev, memory_mb=120)
    result = run_trial(task, tmp_path / "trials")
    trial = tmp_path / "trials" / result["trial_name"]
    assert (trial / "agent" / "dev.txt").read_text() == "1\n"  # No space left on device
    info = result["exception_info"]
    assert info["exception_type"] == "MemoryLimitExceededError"
    message = info["exception_message"]
    assert "memory" in message and "120 MB" in message and "114 MB" in message
    peak = int(message.split("peak of ")[1].split(" MB")[0])
    assert 114 < peak < 64 + 64 + 120  # two full tmpfs mounts and the processes under memory_mb
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []


# -- the environment's promises, driven directly ---------------------------------


# What Apptainer adds to a process's environment that Docker's containers never show.
APPTAINER_TRACES = ("APPTAINER_", "SINGULARITY_", "ENGINE_CONFIG", "PS1=", "PROMPT_COMMAND=")


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.parametrize(
    "image", ["debian_sif", pytest.param("nopython_sif", marks=pytest.mark.registry)]
)
def test_no_process_of_the_container_shows_apptainers_variables(
    image: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A task cannot tell it is not in Docker from any environment it can read: PID 1's (the
    command server, started again in Docker's environment), every other process's, and its
    own, each the image's ENV with HOME and PATH, and nothing of Apptainer's."""
    sif: Path = request.getfixturevalue(image)

    async def main() -> None:
        async with started(sif, tmp_path) as environment:
            first = await environment.exec("tr '\\0' '\\n' </proc/1/environ")
            every = await environment.exec(
                "for p in /proc/[0-9]*; do tr '\\0' '\\n' <$p/environ 2>/dev/null; done"
            )
            own = await environment.exec("env")
            init = await environment.exec("tr '\\0' ' ' </proc/1/cmdline")
        assert first.return_code == 0 and first.stdout.strip(), first.stderr
        for said in (first.stdout, every.stdout, own.stdout):
            lines = said.splitlines()
            assert [line for line in lines if line.startswith(APPTAINER_TRACES)] == [], said
            assert not [line for line in lines if "/.singularity.d" in line], said
        pid1 = dict(line.partition("=")[::2] for line in first.stdout.splitlines() if line)
        image_env = (image_config(sif) or ImageConfig()).env
        assert {name: pid1.get(name) for name in image_env} == image_env
        assert {"HOME", "PATH"} <= set(pid1)
        assert "server" in init.stdout  # our server is PID 1, no Apptainer shim

    asyncio.run(main())


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.parametrize(
    "image", ["debian_sif", pytest.param("nopython_sif", marks=pytest.mark.registry)]
)
def test_the_container_outlives_what_a_task_does_to_its_processes(
    image: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """As a Docker container's init: every signal a task may send (`kill -9 -1`, any signal to
    its pid 1) leaves the container and its command server up, and the killer's own command is
    answered with its status (python3's server and bash's alike)."""
    sif: Path = request.getfixturevalue(image)
    signals = "; ".join(
        f"kill -{name} 1" for name in ("INT", "TERM", "HUP", "QUIT", "USR1", "KILL")
    )

    async def main() -> list[tuple[int, str]]:
        async with started(sif, tmp_path) as environment:
            await environment.exec("sleep 600 > /dev/null 2>&1 &")
            said = []
            for command in ("kill -9 -1; echo after", f"{signals}; echo sent", "echo alive"):
                result = await environment.exec(command, timeout_sec=30)
                said.append((result.return_code, result.stdout))
            return said

    assert asyncio.run(main()) == [(0, "after\n"), (0, "sent\n"), (0, "alive\n")]


@pytest.mark.apptainer
@pytest.mark.docker
def test_the_command_after_a_kill_of_every_process_runs_once(
    debian_sif: Path, tmp_path: Path
) -> None:
    """`kill -9 -1` also kills the shells the server keeps waiting for the next command; one
    may still be dying, not yet reaped, as that command comes (a loaded node: one in 25 here).
    The command runs in a fresh shell instead, once: never answered as killed (137, no output)."""

    async def main() -> list[str]:
        async with started(debian_sif, tmp_path) as environment:
            said = []
            for _ in range(30):
                await environment.exec("kill -9 -1")
                result = await environment.exec("echo x >> /tmp/runs; echo ok", timeout_sec=30)
                said.append(f"{result.return_code} {result.stdout.strip()}")
            runs = await environment.exec("wc -l < /tmp/runs")
            return [*set(said), runs.stdout.strip()]

    assert asyncio.run(main()) == ["0 ok", "30"]


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.parametrize(
    "image", ["debian_sif", pytest.param("nopython_sif", marks=pytest.mark.registry)]
)
def test_exec_fidelity(image: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    sif: Path = request.getfixturevalue(image)

    async def main() -> None:
        async with started(sif, tmp_path) as environment:
            result = await environment.exec(
                "printf '  out\\n\\n'; printf ' err \\t\\n' >&2; exit 7"
            )
            assert (result.stdout, result.stderr, result.return_code) == (
                "  out\n\n",
                " err \t\n",
                7,
            )
            big = await environment.exec("head -c 1000000 /dev/zero | tr '\\0' 'a'; echo")
            assert big.stdout == "a" * 1_000_000 + "\n"
            where = await environment.exec(
                "pwd; echo $GREETING", cwd="/tmp", env={"GREETING": "a b"}
            )
            assert where.stdout == "/tmp\na b\n"
            assert (await environment.exec("pwd")).stdout == "/\n"  # the image has no WORKDIR
            with pytest.raises(RuntimeError, match="timed out after 1 seconds"):
                await environment.exec("sleep 30 & echo $! > /tmp/bg; wait", timeout_sec=1)
            # The background sleep died with its group (a zombie until someone reaps it).
            state = await environment.exec(
                "for i in $(seq 20); do set -- $(cat /proc/$(cat /tmp/bg)/stat 2>/dev/null);"
                ' case "${3:-gone}" in gone|Z) break;; esac; sleep 0.1; done; echo "${3:-gone}"'
            )
            assert state.stdout in ("gone\n", "Z\n")
            as_root = await environment.exec("id -u", user="root")
            assert as_root.return_code == 0
            streamed: dict[str, list[str]] = {"stdout": [], "stderr": []}

            async def collect(text: str, stream: str) -> None:
                streamed[stream].append(text)

            with environment.scoped_output_callback(collect):
                shown = await environment.exec("echo één; echo twee >&2; echo drie")
            assert "".join(streamed["stdout"]) == shown.stdout == "één\ndrie\n"
            assert "".join(streamed["stderr"]) == shown.stderr == "twee\n"

    asyncio.run(main())


@pytest.mark.apptainer
@pytest.mark.docker
def test_files_round_trip_with_spaces_and_a_large_file(debian_sif: Path, tmp_path: Path) -> None:
    source = tmp_path / "my folder"
    (source / "sub dir").mkdir(parents=True)
    (source / "sub dir" / "a file.txt").write_text("inside\n")
    large = source / "large file.bin"
    large.write_bytes(os.urandom(1 << 20) * 40)

    async def main() -> None:
        async with started(debian_sif, tmp_path / "env") as environment:
            await environment.upload_file(large, "/data dir/copy of large.bin")
            await environment.upload_dir(source, "/up loaded")
            listing = await environment.exec("cat '/up loaded/sub dir/a file.txt'")
            assert listing.stdout == "inside\n"
            await environment.download_file("/data dir/copy of large.bin", tmp_path / "back.bin")
            await environment.download_dir("/up loaded", tmp_path / "back dir")

    asyncio.run(main())
    assert (tmp_path / "back.bin").read_bytes() == large.read_bytes()
    assert (tmp_path / "back dir" / "sub dir" / "a file.txt").read_text() == "inside\n"
    assert (tmp_path / "back dir" / "large file.bin").read_bytes() == large.read_bytes()


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.parametrize(
    "image", ["debian_sif", pytest.param("nopython_sif", marks=pytest.mark.registry)]
)
def test_nothing_left_after_stop(
    image: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    sif: Path = request.getfixturevalue(image)

    async def main() -> tuple[list[int], Path]:
        environment = make_environment(str(sif), tmp_path)
        await environment.start(force_build=False)
        # A daemon that double-forks out of the script's session and process tree.
        spawn = "(setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $! > /tmp/daemon.pid)"
        await environment.exec(spawn)
        assert environment.process_pid is not None and environment.staging_host_dir is not None
        daemon = host_pid(
            environment.process_pid, int((await environment.exec("cat /tmp/daemon.pid")).stdout)
        )
        tree = process_tree(environment.process_pid)
        staging = environment.staging_host_dir
        names = set()
        for pid in tree:  # a warm shell may end and be replaced while we look
            with contextlib.suppress(psutil.NoSuchProcess):
                names.add(psutil.Process(pid).name())
        # Its root is an overlay of our own (with or without a subuid range): no FUSE daemon
        # of Apptainer's in its tree, which starts in the holder's namespaces.
        assert not {"squashfuse_ll", "fuse-overlayfs"} & names, names
        assert "nsenter" in names, names
        await environment.stop(delete=True)
        return [*tree, daemon], staging

    pids, staging = asyncio.run(main())
    assert still_running(pids) == []
    assert not staging.parent.exists()
    assert sif.exists()


HOST_THAT_DIES = """
import asyncio, json, logging, os, signal, sys
from pathlib import Path
from harbor_hpc.containers.watchdog import process_tree
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths
from harbor_hpc.containers.environment import SingularityEnvironment

async def main():
    folder = Path(sys.argv[2])
    paths = TrialPaths(folder / "trial")
    paths.mkdir()
    (folder / "environment").mkdir()
    environment = SingularityEnvironment(
        environment_dir=folder / "environment", environment_name="crash", session_id="crash__env",
        trial_paths=paths, task_env_config=EnvironmentConfig(docker_image=sys.argv[1]),
        logger=logging.getLogger("crash"), scratch_dir=folder / "scratch",
    )
    await environment.start(force_build=False)
    # Files of another user of the container: the host's subordinate uids own them.
    await environment.exec("mkdir /tmp/theirs && touch /tmp/theirs/f && chown -R 65534 /tmp/theirs")
    await environment.exec("(setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $! > /tmp/d)")
    inside = (await environment.exec("cat /tmp/d")).stdout.strip()
    def container_pid(pid):  # the container has a pid namespace of its own
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        return [line.split()[-1] for line in lines if line.startswith("NSpid:")][0]
    tree = process_tree(environment.process_pid)
    daemon = [pid for pid in tree if container_pid(pid) == inside][0]
    print(json.dumps([environment.process_pid, daemon]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no stop(): the host dies

asyncio.run(main())
"""


@pytest.mark.apptainer
@pytest.mark.docker
def test_container_ends_when_its_host_dies_and_the_next_removes_its_folder(
    debian_sif: Path, tmp_path: Path
) -> None:
    host = subprocess.run(
        [sys.executable, "-c", HOST_THAT_DIES, str(debian_sif), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert host.returncode == -9, host.stderr
    apptainer, daemon = json.loads(host.stdout)
    deadline = time.monotonic() + 10
    while still_running([apptainer, daemon]) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = still_running([apptainer, daemon])
    for pid in (apptainer, daemon):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()  # whatever failed the test is not left behind
    assert left == []
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []
    # What the killed host left in its scratch space goes with the next environment there.
    scratch = tmp_path / "scratch"
    (left_behind,) = scratch.glob("harbor-hpc-env-*")

    def still_there() -> list[str]:
        return [str(left_behind)] if left_behind.exists() else []

    (tmp_path / "next").mkdir()

    async def next_one() -> tuple[list[Path], Path | None]:
        async with started(debian_sif, tmp_path / "next", scratch_dir=scratch) as environment:
            await asyncio.to_thread(gone_within, 30, still_there)
            return sorted(scratch.glob("harbor-hpc-env-*")), environment.staging_host_dir

    folders, staging = asyncio.run(next_one())
    assert staging is not None and folders == [staging.parent]  # its own stays while it runs
    assert list(scratch.glob("harbor-hpc-env-*")) == []


OTHER_USER_PROBE = """
import errno, json, os, sys
pids, private = json.loads(sys.argv[1]), sys.argv[2]
denied, reached = [], []
for path in [f"/proc/{pid}/fd/{fd}" for pid in pids for fd in (0, 1)] + [private]:
    try:
        if path == private:
            os.listdir(path)
        else:
            open(path, "rb").close()
        reached.append(path)
    except PermissionError:
        denied.append(path)
    except FileNotFoundError:
        pass
print(json.dumps({"denied": denied, "reached": reached}))
"""


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.other_user
def test_other_user_cannot_reach_the_channel(debian_sif: Path, tmp_path: Path) -> None:
    async def main() -> None:
        async with started(debian_sif, tmp_path) as environment:
            assert environment.process_pid is not None
            assert environment.staging_host_dir is not None
            tree = process_tree(environment.process_pid)
            # Nothing listens on the network: the whole channel is the root's pipes.
            for pid in tree:
                with_sockets = psutil.Process(pid).net_connections(kind="inet")
                assert not [c for c in with_sockets if c.status == psutil.CONN_LISTEN]
            probe = subprocess.run(
                other_user_command(
                    [
                        "/usr/bin/python3",
                        "-c",
                        OTHER_USER_PROBE,
                        json.dumps(tree),
                        str(environment.staging_host_dir.parent),
                    ]
                ),
                capture_output=True,
                text=True,
                check=True,
            )
            outcome = json.loads(probe.stdout)
            assert outcome["reached"] == []
            assert str(environment.staging_host_dir.parent) in outcome["denied"]
            assert f"/proc/{environment.process_pid}/fd/0" in outcome["denied"]
            # Still serving its owner afterwards.
            assert (await environment.exec("echo fine")).stdout == "fine\n"

    asyncio.run(main())


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.parametrize(
    "fakeroot", [pytest.param(False, marks=pytest.mark.apptainer_only), True]
)  # enroot runs tasks as root only
def test_root_in_the_container_or_not(debian_sif: Path, tmp_path: Path, fakeroot: bool) -> None:
    """Whoever runs the tests (CI: an ordinary user) is root inside by default, and with
    fakeroot=false stays themselves, which the trial's folder says; uploads work either way.
    (Without a subuid range, root alone: the no-subuid stage of CI runs this test too.)"""
    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(5 << 20))

    async def main() -> tuple[str, str, str, str]:
        async with started(debian_sif, tmp_path / "env", fakeroot=fakeroot) as environment:
            who = await environment.exec("id -u; touch /tmp/made && echo wrote")
            root = await environment.exec("awk '$2 == \"/\" {print $3}' /proc/mounts | tail -n 1")
            await environment.upload_file(payload, "/tmp/payload.bin")
            size = await environment.exec("stat -c %s /tmp/payload.bin")
            # The server (this shell's parent) is the image's python3: from its own root, or
            # from the image view, which nothing in the container can write.
            server = await environment.exec(
                f"readlink /proc/$PPID/exe; touch {IMAGE_VIEW}/made 2>/dev/null || echo read-only"
            )
            return who.stdout or "", size.stdout or "", server.stdout or "", root.stdout or ""

    who, size, server, root = asyncio.run(main())
    assert who == f"{0 if fakeroot else os.getuid()}\nwrote\n"
    limits = read_limits(tmp_path / "env" / "trial")
    assert (AS_YOU in limits) == (not fakeroot)
    assert (ONE_ID in limits) == (fakeroot and bool(missing_subid_ranges()))
    assert int(size) == payload.stat().st_size
    # The path this machine takes (doctor's "container root" line): the kernel's overlay in a
    # namespace of our own, for root in the container (a subuid range or none); running as
    # the user, Apptainer's own overlay on the .sif (fuse-overlayfs over squashfuse).
    own = fakeroot
    assert root == ("overlay\n" if own else "fuse.fuse-overlayfs\n")
    assert server == (
        "/usr/bin/python3.11\n" if own else f"{IMAGE_VIEW}/usr/bin/python3.11\nread-only\n"
    )


@pytest.mark.apptainer
@pytest.mark.docker
def test_a_scratch_folder_in_memory_is_named(debian_sif: Path, tmp_path: Path) -> None:
    """Nodes whose /tmp is a tmpfs put a container's writable layer in memory, which its
    memory_mb does not count: the trial says so, as doctor does (/dev/shm stands in)."""
    scratch = Path("/dev/shm") / f"harbor-hpc-test-{uuid.uuid4().hex}"

    async def main() -> None:
        async with started(debian_sif, tmp_path / "env", scratch_dir=scratch) as environment:
            assert (await environment.exec("echo x > /root/file && cat /root/file")).stdout == "x\n"

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert IN_MEMORY in read_limits(tmp_path / "env" / "trial")


def test_doctor_names_trial_scratch_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "harbor-hpc.toml").write_text('scratch_dir = "/dev/shm/harbor-hpc-nowhere"\n')
    monkeypatch.setenv("HARBOR_HPC_CONFIG", str(tmp_path / "harbor-hpc.toml"))
    found = trial_scratch_finding()
    assert (
        found.status is Status.WARN and "is a tmpfs" in found.detail and "scratch_dir" in found.fix
    )
    monkeypatch.setenv("HARBOR_HPC_CONFIG", str(tmp_path / "none.toml"))
    (tmp_path / "none.toml").write_text(f'scratch_dir = "{tmp_path}"\n')
    assert trial_scratch_finding().status is Status.OK


@pytest.mark.apptainer
@pytest.mark.docker
def test_no_image_view_for_a_sif_path_a_bind_cannot_name(debian_sif: Path, tmp_path: Path) -> None:
    """Apptainer splits a bind at `:` and `,`: such a .sif's server starts from the overlay."""
    odd = tmp_path / "a,b:c.sif"
    odd.symlink_to(debian_sif)
    assert server_mounts(tmp_path, odd) == ["-B", f"{tmp_path}:/staging"]
    partition = root_partition(debian_sif)
    assert partition is not None
    assert server_mounts(tmp_path, debian_sif)[2:] == [
        "-B",
        f"{debian_sif}:{IMAGE_VIEW}:id={partition.id},image-src=/",
    ]


def test_root_partition_of_what_is_not_a_sif(tmp_path: Path) -> None:
    (tmp_path / "image.sif").write_bytes(b"SIF_MAGIC" * 100)
    assert root_partition(tmp_path / "image.sif") is None
    assert root_partition(tmp_path / "missing.sif") is None


@pytest.mark.apptainer
@pytest.mark.apptainer_only
@pytest.mark.docker
def test_root_partition_is_the_one_apptainer_lists(debian_sif: Path) -> None:
    listed = subprocess.run(
        [find_apptainer(), "sif", "list", str(debian_sif)], capture_output=True, text=True
    ).stdout
    rows = [line.split("|") for line in listed.splitlines() if "Squashfs/*System" in line]
    partition = root_partition(debian_sif)
    assert partition is not None
    start, end = (int(part) for part in rows[0][3].split("-"))
    assert [int(row[0]) for row in rows] == [partition.id]
    assert (partition.offset, partition.size) == (start, end - start)


def foreign_copy(sif: Path, copy: Path, arch: bytes) -> Path:
    """`sif` copied to `copy` with its header's and root partition's architecture `arch` (a SIF
    code: b"04" arm64, b"02" amd64), as an image built for that architecture has them."""
    data = bytearray(sif.read_bytes())
    data[45:47] = arch  # the global header's primary architecture (after launch, magic, version)
    total, table, size = struct.unpack_from("<3q", data, 88)  # descriptors: count, at, bytes
    width = size // total
    for index in range(total):
        entry = table + index * width
        kind, used = struct.unpack_from("<i?", data, entry)
        if used and kind == 0x4004:  # a partition: file system, kind, then its architecture
            data[entry + 209 : entry + 211] = arch
    copy.write_bytes(bytes(data))
    return copy


@pytest.mark.apptainer
@pytest.mark.docker
def test_an_image_of_another_architecture_is_named_so(debian_sif: Path, tmp_path: Path) -> None:
    """An arm64 .sif on an x86_64 node (or the other way round) says both, where its root,
    mounted from the partition, would start and then fail at its first program."""
    node = node_architecture()
    other, code = ("amd64", b"02") if node == "arm64" else ("arm64", b"04")
    foreign = foreign_copy(debian_sif, tmp_path / "foreign.sif", code)
    if apptainer_here():  # Apptainer reads it so too (a node with enroot only has none)
        listed = subprocess.run(
            [find_apptainer(), "sif", "list", str(foreign)], capture_output=True, text=True
        ).stdout
        assert f"Squashfs/*System/{other}" in listed, listed
    environment = make_environment(str(foreign), tmp_path)
    with pytest.raises(ImageUnavailable) as raised:
        asyncio.run(environment.start(force_build=False))
    said = str(raised.value)
    assert f"task unit: its image {foreign}: built for {other}" in said, said
    assert f"is {node} ({platform.machine()}) and cannot run its programs" in said, said
    assert f"--platform linux/{node}" in said
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(foreign)) == []
    assert foreign_architecture(debian_sif) is None


@pytest.mark.apptainer
@pytest.mark.docker
@pytest.mark.registry
def test_image_with_neither_python_nor_bash_fails_clearly(tiny_sif: Path, tmp_path: Path) -> None:
    environment = make_environment(str(tiny_sif), tmp_path)
    # Without a subuid range, Apptainer's fakeroot command runs first, and needs the image's
    # `cat`: what it says is what the start fails with.
    said = "fakeroot: 7: cat: not found" if missing_subid_ranges() else "neither python3 nor bash"
    with pytest.raises(ContainerStartFailed, match=said):
        asyncio.run(environment.start(force_build=False))
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(tiny_sif)) == []


@pytest.mark.apptainer
@pytest.mark.docker
def test_setup_script_failure_raises_with_output(debian_sif: Path, tmp_path: Path) -> None:
    files = tmp_path / "environment" / "files"
    files.mkdir(parents=True)
    (files / "setup.sh").write_text("echo 'half done'\nfalse\n")

    async def main() -> None:
        environment = make_environment(str(debian_sif), tmp_path, env_dir=files.parent)
        with pytest.raises(SetupScriptFailed, match="half done"):
            await environment.start(force_build=False)
        assert environment.process_pid is None

    asyncio.run(main())
    assert gone_within(ENDED_WITHIN_S, lambda: container_processes(debian_sif)) == []
