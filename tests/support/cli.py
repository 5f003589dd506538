"""The real CLI, run as users run it: `python -m harbor_hpc` in this interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def cli(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `harbor-hpc ARGS` as users do, in this Python (in `env`, else this environment)."""
    result = subprocess.run(
        [sys.executable, "-m", "harbor_hpc", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"harbor-hpc {' '.join(args)} failed:\n{result.stderr}")
    return result


def cli_json(*args: str, env: dict[str, str] | None = None) -> Any:
    return json.loads(cli(*args, "--json", env=env).stdout)
