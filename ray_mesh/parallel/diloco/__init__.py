"""DiLoCo on the replicate dim: its settings (:mod:`.config`, checked on the driver) and the
outer loop that runs them on the workers (:mod:`.outer`).

Public as ``ray_mesh.parallel.DiLoCo`` and ``ray_mesh.DiLoCoConfig``; the
checkpoint files of a DiLoCo run are :mod:`ray_mesh.checkpointing.replicas`'.
"""

from ray_mesh.core.diloco_config import DiLoCoConfig as DiLoCoConfig
from ray_mesh.parallel.diloco.outer import DiLoCo as DiLoCo
from ray_mesh.parallel.diloco.outer import replicas_equal as replicas_equal
