"""DiLoCo's settings: :class:`ray_mesh.core.diloco_config.DiLoCoConfig`, re-exported.

They moved to the core with :class:`~ray_mesh.core.layout.Layout`, whose replicate mode
they are; this path keeps working for code that imported them from here.
"""

from ray_mesh.core.diloco_config import DiLoCoConfig

__all__ = ["DiLoCoConfig"]
