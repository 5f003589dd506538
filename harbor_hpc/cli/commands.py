"""Imports every subcommand module so that each registers itself on the app, then keeps each
one's examples as written in its help.

The order is the order of the steps, which is the order `harbor-hpc --help` lists them in.
"""

# isort: off
from harbor_hpc.cli import fetch  # noqa: F401
from harbor_hpc.cli import build  # noqa: F401
from harbor_hpc.cli import convert  # noqa: F401
from harbor_hpc.cli import prep  # noqa: F401
from harbor_hpc.cli import runs  # noqa: F401
from harbor_hpc.cli import doctor  # noqa: F401
from harbor_hpc.cli import ray  # noqa: F401

# isort: on
from harbor_hpc.cli.app import app, keep_examples

keep_examples(app)
