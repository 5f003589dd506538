"""Both command servers and the host's channel client, run on this machine (no container).

The servers are plain scripts (python3's standard library, or bash); running them on the
host checks the protocol, output fidelity, timeouts and kills quickly and anywhere. The
same checks run inside real containers in test_environment.py.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import os
import selectors
import shutil
import signal
import time
import tokenize
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import psutil
import pytest

from harbor_hpc.containers.channel import Channel, ChannelClosed
from harbor_hpc.containers.watchdog import kill_processes, tree_processes
from harbor_hpc.core.templates import template_path

# "py-fork": the python server as on an image whose python3 predates os.posix_spawn (3.8).
SERVERS = ["py", "py-fork", "sh"]
WITHOUT_POSIX_SPAWN = (
    "import os, sys; del os.posix_spawn; sys.argv = sys.argv[1:]; "
    "exec(compile(open(sys.argv[0]).read(), sys.argv[0], 'exec'))"
)
MEGABYTE_SCRIPT = b"head -c 1000000 /dev/zero | tr '\\0' 'a'; printf '\\n\\n  '\n"


@asynccontextmanager
async def host_server(kind: str, folder: Path) -> AsyncIterator[Channel]:
    exchange = folder / "hh"
    for sub in ("req", "out"):
        (exchange / sub).mkdir(parents=True)
    workdir = folder / "work"
    python = shutil.which("python3") or "python3"
    server = str(template_path("apptainer_server.py"))
    if kind == "py":
        argv = [python, "-I", "-S", server, str(workdir)]
    elif kind == "py-fork":
        argv = [python, "-I", "-S", "-c", WITHOUT_POSIX_SPAWN, server, str(workdir)]
    else:
        argv = ["bash", str(template_path("apptainer_server.sh")), str(exchange), str(workdir)]
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
        limit=1 << 20,
    )
    channel = Channel(process, exchange)
    try:
        await asyncio.wait_for(channel.wait_ready(), 10)
        yield channel
    finally:
        await channel.close()
        try:
            await asyncio.wait_for(process.wait(), 5)
        except TimeoutError:
            process.kill()
            await process.wait()


def run_with_server(
    kind: str,
    folder: Path,
    body: Callable[[Channel], Awaitable[None]],
    selector: selectors.BaseSelector | None = None,
) -> None:
    async def main() -> None:
        async with host_server(kind, folder) as channel:
            await body(channel)

    asyncio.run(main(), loop_factory=lambda: asyncio.SelectorEventLoop(selector))


def test_python_server_runs_on_old_python3() -> None:
    """No f-strings (3.6) or other new syntax: the image's python3 may be 3.5."""
    source = template_path("apptainer_server.py").read_text()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    assert not [token for token in tokens if token.type == tokenize.FSTRING_START]
    ast.parse(source, feature_version=(3, 5))


@pytest.mark.parametrize("kind", SERVERS)
def test_greeting_names_server_and_uid(kind: str, tmp_path: Path) -> None:
    async def body(channel: Channel) -> None:
        assert channel.mode == kind.split("-")[0]
        assert channel.uid == os.getuid()

    run_with_server(kind, tmp_path, body)


@pytest.mark.parametrize("kind", SERVERS)
def test_output_is_separate_and_byte_for_byte(kind: str, tmp_path: Path) -> None:
    async def body(channel: Channel) -> None:
        result = await channel.run(b"printf '  out\\n\\n'; printf ' err \\t\\n' >&2; exit 7\n")
        assert result.stdout == b"  out\n\n"
        assert result.stderr == b" err \t\n"
        assert result.exit_code == 7
        assert not result.timed_out
        big = await channel.run(MEGABYTE_SCRIPT)
        assert big.stdout == b"a" * 1_000_000 + b"\n\n  "
        assert big.stderr == b""
        pwd = await channel.run(b"pwd\n")
        assert pwd.stdout.decode().strip() == str(tmp_path / "work")

    run_with_server(kind, tmp_path, body)


@pytest.mark.parametrize("kind", SERVERS)
def test_scripts_run_concurrently(kind: str, tmp_path: Path) -> None:
    async def body(channel: Channel) -> None:
        started = time.monotonic()
        results = await asyncio.gather(
            *(channel.run(f"sleep 0.5; echo {index}\n".encode()) for index in range(5))
        )
        assert [result.stdout for result in results] == [f"{i}\n".encode() for i in range(5)]
        assert time.monotonic() - started < 2.4

    run_with_server(kind, tmp_path, body)


@pytest.mark.parametrize("kind", SERVERS)
def test_timeout_kills_the_whole_process_group(kind: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "background.pid"

    async def body(channel: Channel) -> None:
        script = f"sleep 300 & echo $! > {pid_file}; echo started; wait\n".encode()
        began = time.monotonic()
        result = await channel.run(script, timeout_sec=1)
        assert result.timed_out
        assert time.monotonic() - began < 5
        background = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while psutil.pid_exists(background) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not psutil.pid_exists(background)
        assert (await channel.run(b"echo still serving\n")).stdout == b"still serving\n"

    run_with_server(kind, tmp_path, body)


@pytest.mark.parametrize("kind", SERVERS)
def test_cancelled_wait_kills_the_script(kind: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "script.pid"

    async def body(channel: Channel) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(channel.run(f"echo $$ > {pid_file}; sleep 300\n".encode()), 1)
        script_pid = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while psutil.pid_exists(script_pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not psutil.pid_exists(script_pid)

    run_with_server(kind, tmp_path, body)


@pytest.mark.parametrize("kind", SERVERS)
def test_server_death_fails_waiting_scripts(kind: str, tmp_path: Path) -> None:
    async def body(channel: Channel) -> None:
        waiting = asyncio.ensure_future(channel.run(b"sleep 300\n"))
        await asyncio.sleep(0.3)
        tree = tree_processes(channel.pid)
        os.kill(channel.pid, signal.SIGKILL)
        try:
            with pytest.raises(ChannelClosed, match="exited"):
                await asyncio.wait_for(waiting, 10)
            with pytest.raises(ChannelClosed):
                await channel.run(b"true\n")
        finally:
            kill_processes(tree)  # the script the dead server left running

    run_with_server(kind, tmp_path, body)


class CountingSelector(selectors.DefaultSelector):
    """The event loop's selector, counting how often the loop woke up."""

    wakeups = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(timeout)
        self.wakeups += 1
        return ready


@pytest.mark.parametrize("kind", SERVERS)
def test_an_idle_channel_wakes_nothing(kind: str, tmp_path: Path) -> None:
    """A trainer keeps one environment per rollout slot open in one process: an idle channel
    must not wake the event loop (it learns of the server's end from a pidfd, not by polling)."""
    selector = CountingSelector()

    async def body(channel: Channel) -> None:
        await channel.run(b"true\n")
        await asyncio.sleep(0.3)  # the server's warm shells are up
        before = selector.wakeups
        await asyncio.sleep(2)
        # The sleep's own timer, and at most a stray late frame.
        assert selector.wakeups - before <= 2

    run_with_server(kind, tmp_path, body, selector)


@pytest.mark.parametrize("kind", SERVERS)
def test_close_ends_the_server(kind: str, tmp_path: Path) -> None:
    async def body(channel: Channel) -> None:
        await channel.close()
        assert channel.closed
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(channel.pid).status() != psutil.STATUS_ZOMBIE:
                    await asyncio.sleep(0.05)
                    continue
            return
        raise AssertionError("the server still runs after close()")

    run_with_server(kind, tmp_path, body)
