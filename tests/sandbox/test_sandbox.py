"""The sandbox API a tool-driving trainer uses (harbor_hpc.sandbox), on real containers: open,
exec, upload, download, verify as Harbor's trial does, and every result the policy's or named."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harbor_hpc.core.errors import InputError
from harbor_hpc.results.classify import FailureClass
from harbor_hpc.sandbox.pool import SandboxEnded, SandboxOptions, SandboxPool, SandboxResult
from tests.support.processes import gone_within, left_naming
from tests.support.sample_tasks import make_task

pytestmark = [pytest.mark.apptainer, pytest.mark.harbor]


def test_a_sandbox_runs_the_tasks_verifier_and_its_reward_is_the_policys(
    debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    with SandboxPool(SandboxOptions(trials_dir=tmp_path / "trials")) as pool:
        sandbox = pool.open(task)
        assert sandbox.instruction == "Write 42 into /tmp/answer.\n"
        who = sandbox.exec("id -u; echo $HOME; touch /root/x && echo writable")
        assert who.return_code == 0 and who.stdout.split() == ["0", "/root", "writable"]
        (tmp_path / "in.txt").write_text("42\n")
        sandbox.upload(tmp_path / "in.txt", "/tmp/answer")
        sandbox.download("/tmp/answer", tmp_path / "out.txt")
        assert (tmp_path / "out.txt").read_text() == "42\n"
        solved = sandbox.verify()
        assert (solved.reward, solved.trainable, solved.failure) == (1.0, True, None)
        assert solved.trial_dir is not None and (solved.trial_dir / "result.json").is_file()
        assert sandbox.verify() is solved  # the same result on every later call
        with pytest.raises(SandboxEnded, match="has ended"):
            sandbox.exec("true")

        wrong = pool.open(task)
        wrong.exec("echo 41 > /tmp/answer")
        assert (wrong.verify().training_reward, wrong.verify().trainable) == (0.0, True)


def test_what_the_policy_does_to_its_sandbox_is_scored_as_its_own(
    debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif), memory_mb=256)
    with SandboxPool() as pool:
        killer = pool.open(task)
        killer.exec("kill -9 -1")  # every process the policy can see, as under Docker
        assert killer.exec("echo 42 > /tmp/answer && echo ok").stdout.strip() == "ok"
        assert killer.verify().training_reward == 1.0

        hog = pool.open(task)
        grown = hog.exec(
            "python3 -c 'import time\nb = []\nfor _ in range(128):\n"
            "    b.append(bytearray(8 << 20)); time.sleep(0.02)\ntime.sleep(30)'"
        )
        assert grown.return_code == 137  # the one process killed, as Docker's OOM killer does
        hog.exec("echo 41 > /tmp/answer")
        result = hog.verify()
        assert (result.reward, result.trainable, result.failure) == (0.0, True, None)


def test_a_verifier_that_writes_no_reward_is_named_not_a_zero(
    debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "silent", image=str(debian_sif))
    (task / "tests" / "test.sh").write_text("#!/bin/bash\necho checked\n")
    with SandboxPool() as pool:
        result = pool.open(task).verify()
    assert (result.reward, result.trainable, result.failure) == (None, False, "verifier")
    assert result.training_reward is None and "RewardFile" in (result.message or "")


def test_a_sandbox_whose_image_is_missing_says_so_at_every_call(tmp_path: Path) -> None:
    task = make_task(tmp_path / "tasks", "lost", image=str(tmp_path / "nowhere.sif"))
    with SandboxPool() as pool:
        sandbox = pool.open(task)
        with pytest.raises(SandboxEnded, match=r"nowhere\.sif"):
            sandbox.exec("true")
        result = sandbox.verify()
    assert (result.trainable, result.failure) == (False, FailureClass.IMAGE)


def test_an_episode_past_the_tasks_agent_timeout_is_the_policys(
    debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "slow", image=str(debian_sif), agent_timeout_sec=3)
    with SandboxPool() as pool:
        sandbox = pool.open(task)
        sandbox.exec("echo 42 > /tmp/answer")
        time.sleep(6)
        with pytest.raises(SandboxEnded, match=r"AgentTimeoutError|timeout_sec"):
            sandbox.exec("true")
        result = sandbox.verify()
    # As Harbor's trial of any agent: its time ran out, the verifier still gave the reward.
    assert (result.reward, result.trainable, result.failure) == (1.0, True, FailureClass.TIMEOUT)


def test_bad_settings_and_tasks_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="executor='slurm'"):
        SandboxPool(SandboxOptions(executor="slurm"))
    with pytest.raises(InputError, match="no_such_option"):
        SandboxPool(SandboxOptions(environment_kwargs={"no_such_option": 1}))
    with pytest.raises(InputError, match="ahead=-1"):
        SandboxPool(SandboxOptions(ahead=-1))
    with SandboxPool() as pool:
        with pytest.raises(InputError, match=r"no task\.toml"):
            pool.open(tmp_path)
        task = make_task(tmp_path / "tasks", "untested", image="x.sif")
        (task / "tests" / "test.sh").unlink()
        with pytest.raises(InputError, match=r"test\.sh is missing"):
            pool.open(task)


def test_sandboxes_started_ahead_wait_for_no_start_and_idle_ones_are_given_back(
    debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    trials = tmp_path / "trials"
    with SandboxPool(SandboxOptions(ahead=2, idle_sec=8, trials_dir=trials)) as pool:
        first = pool.open(task)
        first.exec("true")
        deadline = time.monotonic() + 60
        while not all(s.ready for s in pool._spares[task.absolute()]):
            assert time.monotonic() < deadline, "the sandboxes ahead never came up"
            time.sleep(0.2)
        second = pool.open(task)
        assert second.ready  # taken up: its exec waits for no start
        assert second.exec("true").return_code == 0
        # Taking one of those ahead starts no other: one is left, unused, then given back.
        assert len(pool._spares[task.absolute()]) == 1
        assert first.verify().trainable and second.verify().trainable
        assert left_naming(str(trials)) != []
        time.sleep(8)
        assert gone_within(30, lambda: left_naming(str(trials))) == []


def test_sandboxes_are_safe_from_many_threads_and_inside_a_running_loop(
    debian_sif: Path, tmp_path: Path
) -> None:
    tasks = [make_task(tmp_path / "tasks", f"t{i}", image=str(debian_sif)) for i in range(4)]
    with SandboxPool(SandboxOptions(starts=2)) as pool:

        def one(task: Path) -> SandboxResult:
            sandbox = pool.open(task)
            sandbox.exec(f"echo {42 if task.name != 't3' else 0} > /tmp/answer")
            return sandbox.verify()

        with ThreadPoolExecutor(4) as threads:
            rewards = [r.training_reward for r in threads.map(one, tasks)]
        assert rewards == [1.0, 1.0, 1.0, 0.0]

        async def in_a_loop() -> list[float | None]:
            async def one_async(task: Path) -> float | None:
                sandbox = await pool.aopen(task)
                await sandbox.aexec("echo 42 > /tmp/answer")
                return (await sandbox.averify()).training_reward

            return list(await asyncio.gather(*(one_async(t) for t in tasks[:2])))

        assert asyncio.run(in_a_loop()) == [1.0, 1.0]


_DRIVER = """
import sys
from pathlib import Path
from harbor_hpc.sandbox.pool import SandboxPool, SandboxOptions
pool = SandboxPool(SandboxOptions(ahead=1, trials_dir=Path(sys.argv[2])))
sandbox = pool.open(sys.argv[1])
sandbox.exec(f"sleep {sys.argv[3]} >/dev/null 2>&1 &")
print("up", flush=True)
sys.stdin.readline()  # then it exits, its pool not closed
"""


@pytest.mark.parametrize("how", ["kill -9", "exit"])
def test_the_sandboxes_of_a_driver_that_ends_end_with_it(
    how: str, debian_sif: Path, tmp_path: Path
) -> None:
    task = make_task(tmp_path / "tasks", "answer", image=str(debian_sif))
    trials, sleep = tmp_path / "trials", f"{900 + os.getpid() % 97}.{len(how)}"
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(task), str(trials), sleep],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert driver.stdout is not None
    assert driver.stdout.readline().strip() == "up"

    def left() -> list[str]:  # its containers (named by their trials' folders), what ran in them
        return left_naming(str(trials)) + left_naming(f"sleep {sleep}")

    assert left() != []
    if how == "kill -9":
        os.kill(driver.pid, signal.SIGKILL)
    else:
        driver.communicate("\n", timeout=60)
    driver.wait(60)
    assert gone_within(30, left) == []
