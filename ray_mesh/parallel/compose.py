"""Compose TP and data parallel on one module in torchtitan's order, and read it back whole.

TP first, because FSDP2 shards whatever parameters it finds, and after TP those are DTensors
on ``mesh["tp"]``: FSDP then adds a dp dim to them (2-D FSDP + TP). The other order would
try to tensor-parallelise FSDP's flat shards. With pipeline parallel, this runs once per
stage: :class:`~ray_mesh.parallel.pp.Pipeline` takes :func:`parallelize` as its
``parallelize_fn`` (``ray_mesh.parallel`` makes it the default), so this module needs nothing
from the pipeline and the pipeline nothing from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ray_mesh.parallel.fsdp import Blocks, Mode, apply_fsdp
from ray_mesh.parallel.mesh import MeshOrState, mesh_device
from ray_mesh.parallel.tp import TPPlan, apply_tp


def parallelize(
    module: nn.Module,
    mesh: MeshOrState,
    *,
    tp_plan: TPPlan | None = None,
    dp: Mode = "auto",
    blocks: Blocks = None,
    mixed_precision: Any = None,
    reshard_after_forward: bool | None = None,
    strict_plan: bool = True,
) -> nn.Module:
    """Move ``module`` to this rank's device, apply TP from ``tp_plan``, then data parallel.

    ``dp`` is ``auto`` (FSDP, HSDP or DDP as the mesh's dp dims say; see
    :mod:`ray_mesh.parallel.fsdp`), a mode to insist on, or ``none``. Use the return value: the
    DDP path wraps the module. ``mesh`` is a mesh, or the worker's
    :class:`~ray_mesh.MeshState` (``ray_mesh.get_state()``): its mesh with its layout passed
    explicitly (:mod:`ray_mesh.parallel.picked`).

    Stability: stable
    """
    module = module.to(mesh_device(mesh))
    if tp_plan:
        module = apply_tp(module, mesh, tp_plan, strict=strict_plan)
    return apply_fsdp(module, mesh, blocks=blocks, mode=dp, mixed_precision=mixed_precision,
                      reshard_after_forward=reshard_after_forward)


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def full_tensor(tensor: DTensor) -> torch.Tensor:
    """``tensor`` whole, on every rank of its mesh (a collective), one mesh dim at a time.

    ``DTensor.full_tensor`` gathers FSDP + TP parameters (``_StridedShard`` on ``dp_shard``,
    ``Shard`` on ``tp``) in two all-gathers, innermost dim first, and torch (2.11-2.13) then
    logs a warning on every rank that it cannot merge them. Gathering outermost dim first
    is the same two all-gathers and the same values, and says nothing to the user's console
    (upstream: torch-full-tensor-merge-warning).
    """
    placements = list(tensor.placements)
    for dim, placement in enumerate(placements):
        if not isinstance(placement, Replicate):
            placements[dim] = Replicate()
            tensor = tensor.redistribute(tensor.device_mesh, placements)
    return tensor.to_local()


def full_parameters(modules: nn.Module | Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter as a whole, plain tensor on the CPU, keyed by its name in the model.

    A collective when parameters are DTensors (TP, FSDP): call it on every rank of the mesh,
    in the same order. With pipeline stages, pass this rank's stage modules; the names are the
    full model's (stages keep them), so the parts from every pp rank merge into one dict.

    Stability: stable
    """
    if isinstance(modules, nn.Module):
        modules = [modules]
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        for name, param in _unwrap(module).named_parameters():
            value = full_tensor(param) if isinstance(param, DTensor) else param
            out[name] = value.detach().to("cpu", copy=True)
    return out


def gather_over(group_mesh: DeviceMesh, part: Mapping[str, torch.Tensor],
                ) -> dict[str, torch.Tensor]:
    """Merge every rank's ``part`` over a 1-D mesh (e.g. ``mesh["pp"]``): one dict on all."""
    import torch.distributed as dist

    parts: list[Any] = [None] * group_mesh.size()
    dist.all_gather_object(parts, dict(part), group=group_mesh.get_group())
    merged: dict[str, torch.Tensor] = {}
    for p in parts:
        merged.update(p)
    return merged


__all__ = ["full_parameters", "parallelize"]
