"""The run's layout, as the train function's helpers see it: read off the mesh.

Every mesh ray_mesh builds carries the :class:`~ray_mesh.core.layout.Layout` it was built
for (``ray_mesh.core.bootstrap.mesh_layout``): with ``MeshConfig(mesh="auto", plan=...)``
the layout the backend picked (families x gradient precisions x replicate modes), else the
fixed mesh with the job's replicate mode. The helpers a train function already calls read
it from the mesh they are given, so the function follows the pick without a code change:

- :func:`ray_mesh.parallel.parallelize` / :func:`~ray_mesh.parallel.apply_fsdp` with
  ``mixed_precision`` left unset reduce gradients in the layout's dtype; an explicit
  ``mixed_precision`` (``"fp32"`` too) wins;
- ``replicate_config(mesh)``, ``dp_mode(mesh)`` and ``wrap_replicate(model, mesh)``
  (:mod:`ray_mesh.parallel.replicate`) see DiLoCo when the layout has it.

Nothing here is process-global state of its own: a trial's mesh carries the trial's layout,
the run's mesh the run's. :func:`pick_reason` says why ``mesh="auto"`` picked it.
Ray-free; under torchrun, ``ray_mesh.init_mesh(spec, layout=...)`` sets it.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from ray_mesh.core import bootstrap
from ray_mesh.core.layout import Layout


def layout_of(mesh: DeviceMesh | None = None) -> Layout | None:
    """The layout ``mesh`` (default: this process's, ``ray_mesh.get_mesh()``) was built for;
    None when there is no mesh, or for a mesh ray_mesh did not build.

    Stability: experimental
    """
    if mesh is None:
        if not bootstrap.is_initialized():
            return None
        mesh = bootstrap.get_mesh()
    return bootstrap.mesh_layout(mesh)


def pick_reason() -> str | None:
    """Why ``mesh="auto"`` picked this process's layout; None for a fixed mesh or no mesh.

    Stability: experimental
    """
    if not bootstrap.is_initialized():
        return None
    return bootstrap.get_state().picked or None


def layout_precision(mesh: DeviceMesh | None) -> str | None:
    """``"bf16_grads"`` when ``mesh``'s layout reduces gradients in bf16, else None (fp32)."""
    lay = bootstrap.mesh_layout(mesh) if mesh is not None else None
    return lay.precision if lay is not None else None


__all__ = ["layout_of", "pick_reason"]
