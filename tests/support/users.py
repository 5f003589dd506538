"""Acting as another local user in tests, from root or from an ordinary user.

The tests run as an ordinary user, as cluster users do (CI: `hpcuser`, HARBOR_HPC_TEST_USER).
Some check what *another* local user can or cannot do (HARBOR_HPC_TEST_OTHER_USER, CI:
`hpcuser2`). Root becomes that user with `runuser`; an ordinary user with `sudo -n` (CI's
sudoers drop-in lets the tester do so without a password).

    @pytest.mark.other_user            # root conftest: skip (CI: fail) when this cannot work
    def test_x() -> None:
        subprocess.run(other_user_command(["id", "-u"]), check=True)

The command runs with a clean environment (`env -i`): the other user's HOME, USER and LOGNAME,
the caller's PATH, and what the test passes in `env`. So it sees the same under runuser
(which keeps the caller's environment) as under sudo (which resets it).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

OTHER_USER_VAR = "HARBOR_HPC_TEST_OTHER_USER"
DEFAULT_OTHER_USER = "hpcuser2"


def other_user() -> str:
    """The other local user's name."""
    return os.environ.get(OTHER_USER_VAR) or DEFAULT_OTHER_USER


def other_user_account() -> pwd.struct_passwd:
    """The other user's passwd entry (KeyError when there is no such user)."""
    return pwd.getpwnam(other_user())


def other_user_home() -> Path:
    return Path(other_user_account().pw_dir)


def _becomes_by() -> list[str]:
    user = other_user()
    if os.geteuid() == 0:
        return ["runuser", "-u", user, "--"]
    return ["sudo", "-n", "-u", user, "--"]


def other_user_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """`argv` prefixed so that it runs as the other user, with a clean environment plus `env`."""
    user = other_user()
    base = {
        "HOME": str(other_user_home()),
        "USER": user,
        "LOGNAME": user,
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
    }
    settings = [f"{key}={value}" for key, value in {**base, **(env or {})}.items()]
    return [*_becomes_by(), "env", "-i", *settings, *argv]


@cache
def other_user_problem() -> str | None:
    """Why tests cannot act as the other user here, or None when they can."""
    user = other_user()
    try:
        account = other_user_account()
    except KeyError:
        return f"there is no local user {user!r} (set {OTHER_USER_VAR})"
    if account.pw_uid == os.geteuid():
        return f"the tests already run as {user!r}: it is not another user"
    tool = _becomes_by()[0]
    if shutil.which(tool) is None:
        return f"{tool} is not installed (needed to act as {user!r})"
    try:
        done = subprocess.run(
            other_user_command(["id", "-u"]),
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run a command as {user!r} with {tool}: {exc}"
    if done.returncode != 0 or done.stdout.strip() != str(account.pw_uid):
        detail = (done.stderr or done.stdout).strip().splitlines()
        how = "" if tool == "runuser" else " (no password-less sudo rule for it)"
        return f"cannot run a command as {user!r} with {tool}{how}: {' '.join(detail[:2])}"
    # The tests run this checkout's harbor-hpc as that user too: it must be able to read it.
    done = subprocess.run(
        other_user_command([sys.executable, "-c", "import harbor_hpc"]),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
        cwd="/",
    )
    if done.returncode != 0:
        return (
            f"{user!r} cannot run this checkout's Python ({sys.executable}): make the checkout "
            "and the folders above it readable by others (o+rx), as .ci/run does"
        )
    return None


def lab_group() -> str | None:
    """A group both the tester and the other user belong to (CI: `hpclab`), as a lab's members
    share one; None when there is none."""
    try:
        account = other_user_account()
    except KeyError:
        return None
    theirs = set(os.getgrouplist(account.pw_name, account.pw_gid))
    shared = sorted(set(os.getgroups()) & theirs - {os.getegid(), account.pw_gid})
    return grp.getgrgid(shared[0]).gr_name if shared else None


def lab_group_problem() -> str | None:
    """Why tests cannot share files with the other user through a group, or None."""
    problem = other_user_problem()
    if problem is None and lab_group() is None:
        problem = f"the tester and {other_user()!r} share no group (CI: hpclab)"
    return problem
