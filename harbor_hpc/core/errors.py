"""The one exception type the CLI turns into a clean message and an exit code.

Modules raise `HarborHpcError` for anything a user can fix (bad input, a missing tool, a refused
push); the message names the file, task or member at fault and `hint` says what to do. Anything
else escaping to the CLI is a bug, reported in one line (with the traceback only under `-v`).
"""


class HarborHpcError(Exception):
    """A failure the user can act on. `exit_code` 2 means bad input, 1 a failed operation."""

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code


class InputError(HarborHpcError):
    """Bad input: a path that does not exist, a malformed file, an option that makes no sense."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint, exit_code=2)
