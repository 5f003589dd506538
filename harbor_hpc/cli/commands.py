"""Imports every subcommand module so that each registers itself on the app."""

from harbor_hpc.cli import doctor  # noqa: F401
