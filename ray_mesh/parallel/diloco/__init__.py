"""DiLoCo on the replicate dim: its settings (:mod:`.config`, checked on the driver) and the
outer loop that runs them on the workers (:mod:`.outer`).

``from ray_mesh.parallel.diloco import DiLoCo, DiLoCoConfig`` is the public path; the
checkpoint files of a DiLoCo run are :mod:`ray_mesh.checkpointing.replicas`'.
"""

from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.parallel.diloco.outer import DiLoCo, replicas_equal, tensors_equal

__all__ = ["DiLoCo", "DiLoCoConfig", "replicas_equal", "tensors_equal"]
