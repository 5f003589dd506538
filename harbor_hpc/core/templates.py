"""Files harbor-hpc ships beside its code, in three top-level folders of the repository:
`templates/` (scripts it writes into tasks or runs in containers), `slurm/` (the batch scripts
and lines it gives Slurm) and `manifests/` (the manifest's JSON schema, example manifests).

In a checkout (an editable install) they are read from the repository's folders; a wheel
carries each as `harbor_hpc/_<folder>` (pyproject.toml's force-include).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from string import Template
from typing import Literal

from harbor_hpc.core.errors import HarborHpcError

_PACKAGE = Path(__file__).resolve().parents[1]

Folder = Literal["templates", "slurm", "manifests"]


def template_path(name: str, folder: Folder = "templates") -> Path:
    for place in (_PACKAGE / f"_{folder}", _PACKAGE.parent / folder):
        if (place / name).is_file():
            return place / name
    raise FileNotFoundError(f"{folder}/{name} is missing from this harbor-hpc installation")


def read_template(name: str, folder: Folder = "templates") -> str:
    return template_path(name, folder).read_text()


def render_template(name: str, values: Mapping[str, str], folder: Folder = "templates") -> str:
    """The template `name` with each `${key}` replaced by `values[key]` as given (Python's
    string.Template, where `$$` is a dollar sign): a caller shell-quotes the values that are
    shell words (shlex.quote). A site's edit that names no known value, or leaves a lone `$`,
    is named with its file."""
    path = template_path(name, folder)
    try:
        return Template(path.read_text()).substitute(values)
    except (KeyError, ValueError) as exc:
        given = ", ".join(sorted(values)) or "nothing"
        raise HarborHpcError(
            f"{path}: cannot render it ({type(exc).__name__}: {exc})",
            hint=f"harbor-hpc fills in {given} (each written ${{name}}); write a dollar sign as $$",
        ) from None
