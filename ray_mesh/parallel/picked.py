"""The run's layout, as the train function's helpers see it: passed, or read off the mesh.

The helpers that follow a layout take either the worker's state or a mesh:

- :class:`~ray_mesh.MeshState` (``ray_mesh.get_state()``, the companion of ``get_mesh()``):
  its mesh and its ``layout``, passed explicitly, as torchtitan passes its ``ParallelDims``.
  ``parallelize(model, ray_mesh.get_state())`` needs nothing that is not in its arguments;
- a ``DeviceMesh``: every mesh ray_mesh builds carries the
  :class:`~ray_mesh.core.layout.Layout` it was built for
  (``ray_mesh.core.bootstrap.mesh_layout``; a slice answers its root's), so a function
  written for a plain mesh follows the layout too. A mesh ray_mesh did not build has none.

With ``MeshConfig(mesh="auto", plan=...)`` the layout is the one the backend picked
(families x gradient precisions x replicate modes), else the fixed mesh with the job's
replicate mode; the train function follows the pick without a code change:

- :func:`ray_mesh.parallel.parallelize` / :func:`~ray_mesh.parallel.apply_fsdp` with
  ``mixed_precision`` left unset reduce gradients in the layout's dtype; an explicit
  ``mixed_precision`` (``"fp32"`` too) wins;
- ``replicate_config``, ``dp_mode`` and ``wrap_replicate`` (:mod:`ray_mesh.parallel.replicate`)
  see DiLoCo when the layout has it.

Nothing here is process-global state of its own: a trial's mesh carries the trial's layout,
the run's mesh the run's. :func:`pick_reason` says why ``mesh="auto"`` picked it.
Ray-free; under torchrun, ``ray_mesh.init_mesh(spec, layout=...)`` sets it.
"""

from __future__ import annotations

from ray_mesh.core import bootstrap
from ray_mesh.core.bootstrap import MeshState
from ray_mesh.core.layout import Layout
from ray_mesh.parallel.mesh import MeshOrState


def layout_of(mesh: MeshOrState | None = None) -> Layout | None:
    """The layout of ``mesh``: a :class:`~ray_mesh.MeshState`'s own, or the one a
    ``DeviceMesh`` was built for (default: this process's, ``ray_mesh.get_state()``);
    None when there is no mesh, or for a mesh ray_mesh did not build.

    Stability: experimental
    """
    if mesh is None:
        if not bootstrap.is_initialized():
            return None
        mesh = bootstrap.get_state()
    if isinstance(mesh, MeshState):
        return mesh.layout
    return bootstrap.mesh_layout(mesh)


def pick_reason() -> str | None:
    """Why ``mesh="auto"`` picked this process's layout; None for a fixed mesh or no mesh.

    Stability: experimental
    """
    if not bootstrap.is_initialized():
        return None
    return bootstrap.get_state().picked or None


def layout_precision(mesh: MeshOrState | None) -> str | None:
    """``"bf16_grads"`` when ``mesh``'s layout reduces gradients in bf16, else None (fp32)."""
    lay = layout_of(mesh) if mesh is not None else None
    return lay.precision if lay is not None else None


__all__ = ["layout_of", "pick_reason"]
