"""The import paths users give Harbor: `-e harbor_hpc.environment:SingularityEnvironment`, or
`-e harbor_hpc.environment:RaySingularityEnvironment` for containers on a Ray cluster's nodes
(the `ray` extra; Ray itself is imported only when such an environment starts)."""

from harbor_hpc.containers.environment import SingularityEnvironment
from harbor_hpc.ray.environment import RaySingularityEnvironment

__all__ = ["RaySingularityEnvironment", "SingularityEnvironment"]
