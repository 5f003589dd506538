"""Running external tools (apptainer, sbatch, squeue, docker...): one way, always bounded in time.

`run` never raises for a tool that is missing, hangs or fails: it returns a `Ran` that says so,
and `Ran.why()` gives the one line a message or a table cell needs. Callers that must stop on a
failure turn that line into a `HarborHpcError` naming what they were doing.

`stop_all` ends every tool still running (and what each started), and lets no new one start
but the clean-ups the stop calls for (`cleanup=True`: the `scancel` of a job the command
submitted): a command told to stop (SIGTERM from `scancel`, `kill`, a shutdown) leaves no
`apptainer`, `mksquashfs` or Slurm job of its own behind, and its threads go through their own
clean-up (temporary files) at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Long enough for a busy login node; short enough that a hung tool never hangs a command.
QUICK_TIMEOUT_S = 10.0

# Tools running now, from any thread, so that `stop_all` can end them.
_running: set[subprocess.Popen[str]] = set()
_running_lock = threading.Lock()
_stopping = threading.Event()

# Apptainer colours its errors even when they go to a pipe.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Ran:
    """A finished command: exit code and output, or `error` when it could not run to the end."""

    command: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.returncode == 0

    def why(self) -> str:
        """The last meaningful line of what went wrong."""
        if self.error:
            return self.error
        text = _ANSI_ESCAPE.sub("", self.stderr or self.stdout)
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else f"exit code {self.returncode}"


def run(
    command: list[str],
    *,
    timeout: float = QUICK_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    cleanup: bool = False,
) -> Ran:
    """Run `command` to its end or to `timeout` seconds, capturing its output as text; once
    `stop_all` was called, only a `cleanup`."""
    log.info("$ %s", " ".join(command))
    if _stopping.is_set() and not cleanup:
        return Ran(tuple(command), -1, "", "", f"not started: {STOPPED}")
    try:
        # A session of its own, so that a timeout or an interrupt stops the tool and whatever
        # it started (apptainer's mksquashfs, say), not the tool alone.
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
    except OSError as exc:
        return Ran(tuple(command), -1, "", "", f"cannot run {command[0]}: {exc.strerror or exc}")
    with _running_lock:
        _running.add(process)
    try:
        stdout, stderr = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(process)
        return Ran(tuple(command), -1, "", "", f"{command[0]} did not answer within {timeout:g} s")
    except BaseException:
        _stop(process)
        raise
    finally:
        with _running_lock:
            _running.discard(process)
    if _stopping.is_set() and process.returncode < 0:
        return Ran(tuple(command), process.returncode, stdout, stderr, STOPPED)
    log.debug("exit %s\n%s%s", process.returncode, stdout, stderr)
    return Ran(tuple(command), process.returncode, stdout, stderr)


def _stop(process: subprocess.Popen[str]) -> None:
    _kill(process)
    process.communicate()


def _kill(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


STOPPED = "stopped: harbor-hpc was told to stop"


def stop_all() -> None:
    """End every tool `run` started and start no more (from a signal handler, too)."""
    _stopping.set()
    with _running_lock:
        running = list(_running)
    for process in running:
        _kill(process)
