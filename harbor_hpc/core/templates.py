"""Scripts that harbor-hpc writes into tasks or runs in containers live in `templates/`.

In a checkout (an editable install) they are read from the repository's `templates/`; a wheel
carries the same folder as `harbor_hpc/_templates`.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]


def template_path(name: str) -> Path:
    for folder in (_PACKAGE / "_templates", _PACKAGE.parent / "templates"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"template {name!r} is missing from this harbor-hpc installation")


def read_template(name: str) -> str:
    return template_path(name).read_text()
