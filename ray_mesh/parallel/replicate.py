"""The replicate dim's mode, sync or DiLoCo: parsed on the driver, read in the train function.

A job's ``replicate:`` section (YAML) or ``MeshConfig(replicate=...)`` says how the replicas
on ``dp_replicate`` (one per node, over the slow link) keep together:

- ``mode: sync`` (default): HSDP; every gradient is all-reduced across replicas every step.
- ``mode: diloco``: each replica trains on its own for ``every`` inner steps, then they
  average pseudo-gradients once (:mod:`ray_mesh.parallel.diloco`), e.g.
  ``replicate: {mode: diloco, every: 50, outer_lr: 0.7, outer_momentum: 0.9,
  compress: int8, streaming: 4}``.

The driver reads the section (:func:`ray_mesh.core.layout.parse_replicate`, re-exported
here) into the run's :class:`~ray_mesh.core.layout.Layout`, checks it against the mesh
(:func:`check_mesh`), and every worker's mesh carries that layout; the train function reads
it from the mesh (:func:`replicate_config`) or simply calls :func:`wrap`, which returns
``None`` in sync mode::

    model = parallelize(model, mesh, dp=dp_mode(mesh))  # 'replica' under DiLoCo, else 'auto'
    optim = torch.optim.AdamW(model.parameters())
    dl = wrap(model, mesh)                              # None in sync mode
    for step ...:
        loss.backward(); optim.step(); optim.zero_grad()
        if dl: dl.step()

Ray-free: under torchrun, ``ray_mesh.init_mesh(spec, layout=...)`` gives the mesh its
replicate mode, or pass ``config=`` to :func:`wrap`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ray_mesh.core.bootstrap import get_mesh
from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.core.layout import parse_replicate as parse_replicate
from ray_mesh.parallel.mesh import MeshOrState
from ray_mesh.parallel.picked import layout_of

if TYPE_CHECKING:
    from ray_mesh.parallel.diloco import DiLoCo

MODES = ("sync", "diloco")


def replicate_config(mesh: MeshOrState | None = None) -> DiLoCoConfig | None:
    """The DiLoCo settings of ``mesh``'s layout (a mesh or a :class:`~ray_mesh.MeshState`;
    default: this process's), or None in sync mode (and when there is no mesh).

    Stability: experimental
    """
    lay = layout_of(mesh)
    return lay.diloco if lay is not None else None


def dp_mode(mesh: MeshOrState | None = None) -> str:
    """The ``dp=`` to give :func:`~ray_mesh.parallel.parallelize` for ``mesh``'s replicate
    mode (default: this process's mesh).

    Stability: experimental
    """
    return "replica" if replicate_config(mesh) is not None else "auto"


def wrap(model: torch.nn.Module, mesh: MeshOrState | None = None,
         config: DiLoCoConfig | None = None) -> DiLoCo | None:
    """A :class:`DiLoCo` around ``model`` when the replicate mode is diloco, else None.

    ``mesh`` (a mesh or a :class:`~ray_mesh.MeshState`) defaults to this process's,
    ``config`` to ``mesh``'s replicate mode.
    The model must be sharded inside a replica only (``parallelize(..., dp=dp_mode())``).

    Stability: experimental
    """
    config = config if config is not None else replicate_config(mesh)
    if config is None:
        return None
    from ray_mesh.parallel.diloco import DiLoCo  # DTensor's imports: only where it runs

    return DiLoCo(model, mesh if mesh is not None else get_mesh(), config)


__all__ = ["dp_mode", "replicate_config", "wrap"]
