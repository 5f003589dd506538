"""The import path users give Harbor: `-e harbor_hpc.environment:SingularityEnvironment`."""

from harbor_hpc.apptainer.environment import SingularityEnvironment

__all__ = ["SingularityEnvironment"]
