"""The host end of the channel to the in-container command server.

The server is the container's main process and the channel is its stdin/stdout,
two pipes that only this process holds: nothing listens on the network (Apptainer
shares the host's network namespace, so a port would be open to every user on the
node), and another user cannot open another user's pipes. The protocol is
documented in `templates/apptainer_server.py`; many scripts can run at once, each
answered by its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

OutputStream = str  # "stdout" or "stderr"
ChunkCallback = Callable[[OutputStream, bytes], None]

_STREAMS = {b"O": "stdout", b"E": "stderr"}


class ChannelClosed(RuntimeError):
    """The server (the container) went away; its stderr tail says why when known."""


@dataclass
class CommandOutput:
    stdout: bytes
    stderr: bytes
    exit_code: int
    timed_out: bool


@dataclass
class _Pending:
    future: asyncio.Future[CommandOutput]
    on_chunk: ChunkCallback | None
    chunks: dict[OutputStream, list[bytes]] = field(
        default_factory=lambda: {"stdout": [], "stderr": []}
    )


# What the bash server writes of a script: its output, and what its shell notes of itself.
_SH_OUTPUTS = (".out", ".err", ".pid", ".status")


class Channel:
    """Runs shell scripts in the container through the server on the other end of `process`.

    `exchange_dir` is the host path of the folder the bash server (images without
    python3) exchanges scripts and their output through.
    """

    def __init__(self, process: asyncio.subprocess.Process, exchange_dir: Path) -> None:
        if process.stdin is None or process.stdout is None:
            raise ValueError("the server process needs stdin and stdout pipes")
        self._process = process
        self._writer = process.stdin
        self._reader = process.stdout
        self._exchange_dir = exchange_dir
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._hello: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
        self._closed_reason: str | None = None
        self._reader_task = asyncio.create_task(self._read_frames())
        self._exit_task = asyncio.create_task(self._watch_exit())
        self.mode = ""
        self.uid = -1

    async def wait_ready(self) -> None:
        """Wait for the server's greeting: which server runs ("py" or "sh") and as which uid."""
        self.mode, self.uid = await self._hello

    @property
    def pid(self) -> int:
        """The host pid of the server's process (Apptainer's, for a container)."""
        return self._process.pid

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    async def run(
        self,
        script: bytes,
        *,
        timeout_sec: float | None = None,
        on_chunk: ChunkCallback | None = None,
    ) -> CommandOutput:
        """Run `script` with the container's shell; a timeout kills its process group."""
        if self._closed_reason is not None:
            raise ChannelClosed(self._closed_reason)
        job_id = str(next(self._ids))
        timeout_ms = "-" if timeout_sec is None else str(max(1, int(timeout_sec * 1000)))
        pending = _Pending(asyncio.get_running_loop().create_future(), on_chunk)
        self._pending[job_id] = pending
        if self.mode == "sh":
            request_dir = self._exchange_dir / "req"
            (request_dir / f"{job_id}.sh").write_bytes(script)
            frame = f"X {job_id} {timeout_ms}\n".encode()
        else:
            frame = f"X {job_id} {timeout_ms} {len(script)}\n".encode() + script
        try:
            self._writer.write(frame)
            await self._writer.drain()
            return await pending.future
        except asyncio.CancelledError:
            # Whoever waited gave up (e.g. Harbor's own agent timeout): stop the script too.
            self._send_quietly(f"K {job_id}\n".encode())
            raise
        except (ConnectionError, BrokenPipeError) as exc:
            raise ChannelClosed(self._closed_reason or str(exc)) from exc
        finally:
            self._pending.pop(job_id, None)
            if self.mode == "sh":
                self._remove_exchange_files(job_id)

    async def close(self, timeout_sec: float = 5.0) -> None:
        """Ask the server to quit (its running scripts are killed) and read to the end."""
        self.shutdown()
        await self.wait_closed(timeout_sec)

    def shutdown(self) -> None:
        """Ask the server to quit and send nothing more."""
        self._send_quietly(b"Q\n")
        with contextlib.suppress(Exception):
            self._writer.close()

    async def wait_closed(self, timeout_sec: float) -> None:
        """Read what the server still says until its end (at most `timeout_sec`), then stop."""
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(self._reader_task), timeout_sec)
        for task in (self._reader_task, self._exit_task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._closed_reason is None:
            self._fail_all("the channel was closed")

    def _send_quietly(self, frame: bytes) -> None:
        if self._closed_reason is None and not self._writer.is_closing():
            with contextlib.suppress(Exception):
                self._writer.write(frame)

    async def _read_frames(self) -> None:
        try:
            while True:
                header = await self._reader.readline()
                if not header:
                    break
                self._handle(header.split(), await self._payload(header))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            self._fail_all(f"the container's command channel broke: {exc}")
            return
        self._fail_all("the container exited")

    async def _watch_exit(self) -> None:
        """Fail waiting scripts when the server's process ends, even if something it
        left behind still holds the pipe open (so the reader never sees its end)."""
        status = await self._exit_status()
        # Frames written just before the end are still in the pipe: let the reader take them.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader_task), 0.5)
        if self._closed_reason is None:
            self._fail_all(f"the container exited (status {status})")

    async def _exit_status(self) -> int:
        """The server process's exit status, as soon as it exits: woken by a pidfd of it,
        where the kernel has them (nothing runs meanwhile), else looked at four times a second.
        Not `process.wait()`: asyncio answers it only once every pipe is closed too."""
        process = self._process
        pidfd = None
        if process.returncode is None:
            with contextlib.suppress(AttributeError, OSError):
                pidfd = os.pidfd_open(process.pid)
        if pidfd is not None:
            loop = asyncio.get_running_loop()
            exited = asyncio.Event()
            loop.add_reader(pidfd, exited.set)
            try:
                await exited.wait()
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
        # asyncio's child watcher sets the status just after the process ended.
        while (status := process.returncode) is None:
            await asyncio.sleep(0.25 if pidfd is None else 0.01)
        return status

    async def _payload(self, header: bytes) -> bytes:
        if header[:1] in _STREAMS:
            return await self._reader.readexactly(int(header.split()[2]))
        return b""

    def _handle(self, fields: list[bytes], payload: bytes) -> None:
        tag = fields[0]
        if tag == b"H":
            if not self._hello.done():
                self._hello.set_result((fields[1].decode(), int(fields[2])))
            return
        pending = self._pending.get(fields[1].decode())
        if pending is None or pending.future.done():
            return  # a script we stopped waiting for
        if tag in _STREAMS:
            stream = _STREAMS[tag]
            pending.chunks[stream].append(payload)
            if pending.on_chunk is not None:
                pending.on_chunk(stream, payload)
        elif tag == b"R":
            stdout = b"".join(pending.chunks["stdout"])
            stderr = b"".join(pending.chunks["stderr"])
            if self.mode == "sh":
                stdout, stderr = self._read_exchange_output(fields[1].decode(), pending)
            pending.future.set_result(
                CommandOutput(stdout, stderr, int(fields[2]), fields[3:4] == [b"t"])
            )

    def _read_exchange_output(self, job_id: str, pending: _Pending) -> tuple[bytes, bytes]:
        outputs = []
        for suffix, stream in ((".out", "stdout"), (".err", "stderr")):
            path = self._exchange_dir / "out" / f"{job_id}{suffix}"
            data = path.read_bytes() if path.exists() else b""
            if data and pending.on_chunk is not None:
                pending.on_chunk(stream, data)
            outputs.append(data)
        return outputs[0], outputs[1]

    def _remove_exchange_files(self, job_id: str) -> None:
        for path in (
            self._exchange_dir / "req" / f"{job_id}.sh",
            *(self._exchange_dir / "out" / f"{job_id}{suffix}" for suffix in _SH_OUTPUTS),
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _fail_all(self, reason: str) -> None:
        self._closed_reason = reason
        if not self._hello.done():
            self._hello.set_exception(ChannelClosed(reason))
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.set_exception(ChannelClosed(reason))
