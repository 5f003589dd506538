"""The three-node cluster .ci/provision.sh makes, for bench scripts: the environment in which
Slurm's commands talk to it, and a new folder of the caller's that every node sees."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def multinode_work(prefix: str) -> tuple[dict[str, str], Path]:
    """This environment with the three-node cluster's slurm.conf, and a new folder `prefix...`
    in the folder its nodes share; exits saying what to source when the cluster is not named."""
    conf = os.environ.get("HARBOR_HPC_TEST_MULTI_SLURM_CONF")
    shared = os.environ.get("HARBOR_HPC_TEST_SHARED_DIR")
    if not conf or not shared:
        sys.exit("needs the multi-node cluster: source /var/lib/harbor-hpc-ci/env.sh first")
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getuid()}-", dir=shared))
    return {**os.environ, "SLURM_CONF": conf}, work
