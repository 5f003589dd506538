"""Why a trial failed inside our environment, as exception types Harbor records by name.

Harbor stores a failed trial's exception type and message in result.json (`exception_info`);
`harbor-hpc status` classifies failures by these names, so keep them stable.
"""


class MemoryLimitExceeded(RuntimeError):
    """The memory watchdog killed the container: its message names the limit and the peak."""


class SetupScriptFailed(RuntimeError):
    """environment/files/setup.sh exited non-zero; the message carries its output."""


class ImageUnavailable(RuntimeError):
    """The task's image (a .sif path or a registry reference) could not be found or converted."""


class ContainerStartFailed(RuntimeError):
    """Apptainer could not start the container or its command server; its output follows."""


class ContainerDied(RuntimeError):
    """The container ended while the trial was using it, for a reason other than memory."""


class EnvironmentHostUnavailable(ContainerDied):
    """Nothing can run the container, or still runs it: its Ray node was lost, the process
    serving it there died, the cluster ended or never answered, or no node had room for it.
    The message names the node or the cluster."""


class UnsupportedTask(RuntimeError):
    """The task needs something this environment cannot give it faithfully (a compose feature
    one pod cannot honour, named in the message)."""
