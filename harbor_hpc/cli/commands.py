"""Imports every subcommand module so that each registers itself on the app."""

from harbor_hpc.cli import (
    convert,  # noqa: F401
    doctor,  # noqa: F401
    fetch,  # noqa: F401
    prep,  # noqa: F401
    runs,  # noqa: F401
)
