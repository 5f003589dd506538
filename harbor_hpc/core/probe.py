"""What a probe of this machine found: one fact, how it stands, and what to do about it.

Each layer probes the part it drives (containers/probes.py the runtime, images/engine.py the
Docker Engine) and says so in `Finding`s; `harbor-hpc doctor` only gathers them by role. The
install itself (Harbor and the other Python packages) is probed here, below every layer.
"""

from __future__ import annotations

import os
import pwd
import re
import sys
from dataclasses import dataclass
from enum import StrEnum

MIN_HARBOR = (0, 26)
_REINSTALL = "`uv sync` in the checkout, or reinstall harbor-hpc"


class Status(StrEnum):
    OK = "ok"
    WARN = "warn"
    MISSING = "missing"


@dataclass(frozen=True)
class Finding:
    """One checked fact: `detail` says what was seen, `fix` (when not OK) what to do."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def harbor_finding() -> Finding:
    import importlib.metadata  # here: it takes a few hundredths of a second to load

    fix = "install it into this environment: `uv sync` in the checkout, or `pip install harbor`"
    try:
        importlib.import_module("harbor")
        version = importlib.metadata.version("harbor")
    except Exception as exc:
        return Finding("package", Status.WARN, f"not importable: {exc}", fix)
    if version_tuple(version) < MIN_HARBOR:
        wanted = ".".join(map(str, MIN_HARBOR))
        return Finding("package", Status.WARN, f"{version}, needs >= {wanted}", fix)
    return Finding("package", Status.OK, f"harbor {version}")


def python_finding() -> Finding:
    import importlib.metadata

    here = f"Python {sys.version.split()[0]} ({sys.executable})"
    absent = []
    declared = _declared_dependencies()
    for name in declared:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
    if absent:
        detail = f"{here}; not installed: {', '.join(absent)}"
        return Finding("packages", Status.WARN, detail, _REINSTALL)
    return Finding("packages", Status.OK, f"{here}; {len(declared)} dependencies found")


def _declared_dependencies() -> list[str]:
    """The packages harbor-hpc's metadata declares (its extras and Harbor, probed on its own,
    aside): the list in pyproject.toml, never a copy of it."""
    import importlib.metadata

    try:
        requirements = importlib.metadata.requires("harbor-hpc") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    names = (
        re.split(r"[\s<>=!~;\[(]", text, maxsplit=1)[0]
        for text in requirements
        if "extra" not in text
    )
    return [name for name in names if name.lower() != "harbor"]


def version_tuple(version: str) -> tuple[int, ...]:
    """`0.24.0` as (0, 24, 0), for comparing versions."""
    numbers = []
    for piece in version.split("."):
        digits = "".join(char for char in piece if char.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def current_user() -> str:
    """The user's name for messages and fixes (the uid where it has none)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())
