"""What starts task containers (base.Runtime): Apptainer or enroot, chosen per node."""

from __future__ import annotations

import os

from harbor_hpc.core.config import load_config
from harbor_hpc.core.errors import HarborHpcError, InputError
from harbor_hpc.runtimes.apptainer import Apptainer, find_apptainer
from harbor_hpc.runtimes.base import Runtime
from harbor_hpc.runtimes.enroot import Enroot, find_enroot

RUNTIMES: dict[str, Runtime] = {"apptainer": Apptainer(), "enroot": Enroot()}
RUNTIME_ENV = "HARBOR_HPC_RUNTIME"


def container_runtime(setting: str | None = None) -> Runtime:
    """What starts this node's containers: `setting` (the environment's `runtime`), else
    $HARBOR_HPC_RUNTIME, else the config file's `runtime`; `auto` (the default) is Apptainer
    where there is one (on PATH, or `HARBOR_HPC_APPTAINER`), else enroot where there is that;
    neither is a HarborHpcError naming both."""
    chosen = setting or os.environ.get(RUNTIME_ENV) or load_config().values.get("runtime")
    chosen = chosen or "auto"
    if chosen not in (*RUNTIMES, "auto"):
        raise InputError(
            f"runtime {chosen!r} is none of {', '.join(RUNTIMES)}, auto",
            hint=f"fix the environment's runtime, ${RUNTIME_ENV} or the config file's runtime",
        )
    if chosen != "auto":
        return RUNTIMES[chosen]
    try:
        find_apptainer()
    except HarborHpcError:
        if find_enroot() is not None:
            return RUNTIMES["enroot"]
        raise HarborHpcError(
            "no container runtime here: neither Apptainer (apptainer, singularity) nor enroot "
            "is on PATH",
            hint="load one (`module load apptainer`, `module load enroot`), or name it with "
            "HARBOR_HPC_APPTAINER or HARBOR_HPC_ENROOT",
        ) from None
    return RUNTIMES["apptainer"]
