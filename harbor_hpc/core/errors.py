"""The one exception type the CLI turns into a clean message and an exit code.

Modules raise `HarborHpcError` for anything a user can fix (bad input, a missing tool, a refused
push); the message names the file, task or member at fault and `hint` says what to do. A command
whose report already names each of its failures ends with `ReportedFailure` (exit 1). Anything
else escaping to the CLI is a bug, reported in one line (with the traceback only under `-v`),
except the machine's own refusals (a full disk, a quota, a permission, a read-only filesystem),
which `from_os_error` names wherever they surface.
"""

from __future__ import annotations

import errno
from enum import StrEnum
from pathlib import Path

# What to do, and the exit code: the machine is full (1), or the path the user chose is not theirs
# to use (2, bad input).
_OS_HINTS = {
    errno.ENOSPC: (
        "free space on that filesystem or write elsewhere, then run again: finished work is kept",
        1,
    ),
    errno.EDQUOT: ("your disk quota is used up: free some or write elsewhere, then run again", 1),
    errno.EACCES: ("use a path you may write (and read), or fix its permissions", 2),
    errno.EPERM: ("use a path you may write (and read), or fix its permissions", 2),
    errno.EROFS: ("that filesystem is read-only: write elsewhere", 2),
}


class HarborHpcError(Exception):
    """A failure the user can act on. `exit_code` 2 means bad input, 1 a failed operation."""

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code


class ReportedFailure(HarborHpcError):
    """Part of a command's work failed, and the report it printed already names each failure:
    the CLI exits 1 and adds nothing to it."""

    def __init__(self) -> None:
        super().__init__("part of the work failed: the report above names each failure")


class InputError(HarborHpcError):
    """Bad input: a path that does not exist, a malformed file, an option that makes no sense."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, exit_code=2)


def from_os_error(exc: OSError, path: Path | str | None = None) -> HarborHpcError | None:
    """The user's error for an OSError the machine raised (ENOSPC, EDQUOT, EACCES, EPERM,
    EROFS), naming `path` (else the error's own file name); None for any other OSError."""
    known = _OS_HINTS.get(exc.errno or 0)
    if known is None:
        return None
    hint, exit_code = known
    where = path if path is not None else exc.filename
    said = exc.strerror or str(exc)
    return HarborHpcError(f"{where}: {said}" if where else said, hint=hint, exit_code=exit_code)


def choice[E: StrEnum](kind: type[E], value: object, name: str) -> E:
    """`value` as a member of `kind`: a member, or its string value (as a config file, JSON or
    a command line gives it). Anything else is an `InputError` naming `name` and the choices:
    never a silent default."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        for member in kind:
            if member.value == value:
                return member
    known = ", ".join(member.value for member in kind)
    raise InputError(f"{name} {value!r} is not one of {known}")
