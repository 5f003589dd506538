"""The `harbor-hpc` command line. `main` is the console script's entry point."""

from __future__ import annotations

import signal
import sys
import traceback
from types import FrameType
from typing import NoReturn

from rich.markup import escape

from harbor_hpc.cli import commands  # noqa: F401  (registers the subcommands on `app`)
from harbor_hpc.cli.app import app, console, verbosity
from harbor_hpc.core.errors import HarborHpcError, ReportedFailure, from_os_error
from harbor_hpc.core.proc import stop_all


def main() -> None:
    """Run the CLI; user errors become one clear message and an exit code, never a traceback."""
    signal.signal(signal.SIGTERM, _terminated)
    # A terminal closed under a waiting command (an ssh session gone) ends it as `kill` does,
    # cleaning up; under `nohup` the hangup stays ignored.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _terminated)
    try:
        app()
    except ReportedFailure as exc:  # the command's report named each failure already
        sys.exit(exc.exit_code)
    except HarborHpcError as exc:
        _fail(exc)
    except OSError as exc:  # the machine refused (a full disk, a permission) where no step did
        failure = from_os_error(exc)
        if failure is None:
            _internal(exc)
        _fail(failure)
    except KeyboardInterrupt:
        stop_all()
        console.print("[red]interrupted[/]")
        sys.exit(130)
    except _Terminated as exc:  # said here, not in the handler: it may interrupt a print
        console.print("[red]terminated[/]")
        sys.exit(exc.code)
    except Exception as exc:
        _internal(exc)


def _fail(exc: HarborHpcError) -> NoReturn:
    # One line each however long (logs and CI read them), markup in names taken literally.
    console.print(f"[red bold]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
    if exc.hint:
        console.print(f"[dim]hint:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)
    sys.exit(exc.exit_code)


def _internal(exc: Exception) -> NoReturn:
    if verbosity():
        traceback.print_exc()
    console.print(
        f"[red bold]internal error:[/] {type(exc).__name__}: {escape(str(exc))}\n"
        "Run again with -v for the traceback, and please report it.",
        highlight=False,
    )
    sys.exit(1)


class _Terminated(SystemExit):
    """Raised by the handler of SIGTERM and SIGHUP: through every step's clean-up to `main`."""


def _terminated(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (`kill`, `scancel`, a shutdown) or SIGHUP (its terminal gone): end the tools
    under way, let each step clean up after itself (temporary files, locks, a Slurm job it
    still waits for), and exit as a terminated process does."""
    stop_all()
    raise _Terminated(128 + signum)
