"""Put parallelism on the ray_mesh mesh: TP, FSDP2/HSDP/DDP, PP, CP, and data sharding.

Ray-free (plain torch), so the same code runs in Ray Train workers and under torchrun. The
calls take the full mesh from ``ray_mesh.get_mesh()`` and pick their dims themselves:

- :func:`apply_tp` - tensor / sequence parallel from a plan on ``mesh["tp"]``
- :func:`apply_fsdp` - ``fully_shard`` per block then root: FSDP over ``dp_shard_cp``, HSDP over
  (``dp_replicate``, ``dp_shard_cp``), or replicate-only (DDP), as the mesh says
- :func:`parallelize` - TP, then data parallel (torchtitan's order)
- :class:`Pipeline` - cut a sequential model into stages along ``mesh["pp"]`` and run a
  ``torch.distributed.pipelining`` schedule (GPipe, 1F1B, interleaved, ...)
- :func:`context_parallel_region` - CP where torch supports it (CUDA + NCCL), else an error
- :func:`dp_rank`, :func:`dp_size`, :func:`dp_mean`, :func:`shard_batch`,
  :func:`local_batch_size`, :func:`distributed_sampler`, :func:`resumable_sampler` - data
  (the latter, a :class:`ResumableSampler`, resumes mid-epoch)
- :func:`full_parameters` - the whole parameters back from DTensors (checks, export)
- :func:`submesh`, :func:`dim_size`, :func:`mesh_device` - one dim of the mesh (with an error
  that names the fix when it is missing), its size, this rank's device
- :func:`replicate_config`, :func:`replicate_dp_mode`, :func:`wrap_replicate` - the
  replicate dim's mode (sync HSDP or DiLoCo): the run's settings, the ``dp=`` mode for
  ``parallelize`` and the outer loop (a :class:`DiLoCo`), or None
- :func:`layout_of`, :func:`pick_reason` - the :class:`~ray_mesh.core.layout.Layout` the
  mesh was built for (``mesh="auto"``'s pick, or the fixed mesh and its replicate mode) and
  why it was picked; ``parallelize`` and the replicate helpers read it off the mesh

A mesh these helpers cannot use raises :class:`ParallelError` naming the fix.

Stability: stable
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ray_mesh.core import deprecation as _deprecation
from ray_mesh.errors import ParallelError

# Imported on first use (PEP 562), not with the package: the Ray Train backend, the
# controller and the driver import a helper or two from here, and the whole set pulls in
# torch.distributed.tensor and torch.distributed.pipelining (about 1.2 s of imports per
# process, measured on a 2-core machine). The names and what they are stay the same.
_EXPORTS: dict[str, tuple[str, str]] = {
    "full_parameters": ("compose", "full_parameters"),
    "parallelize": ("compose", "parallelize"),
    "context_parallel_region": ("cp", "context_parallel_region"),
    "distributed_sampler": ("data", "distributed_sampler"),
    "dp_mean": ("data", "dp_mean"),
    "dp_rank": ("data", "dp_rank"),
    "dp_size": ("data", "dp_size"),
    "local_batch_size": ("data", "local_batch_size"),
    "resumable_sampler": ("data", "resumable_sampler"),
    "shard_batch": ("data", "shard_batch"),
    "ResumableSampler": ("data_position", "ResumableSampler"),
    "DiLoCo": ("diloco", "DiLoCo"),
    "apply_fsdp": ("fsdp", "apply_fsdp"),
    "dim_size": ("mesh", "dim_size"),
    "mesh_device": ("mesh", "mesh_device"),
    "submesh": ("mesh", "submesh"),
    "layout_of": ("picked", "layout_of"),
    "pick_reason": ("picked", "pick_reason"),
    "Pipeline": ("pp", "Pipeline"),
    "replicate_dp_mode": ("replicate", "dp_mode"),
    "replicate_config": ("replicate", "replicate_config"),
    "wrap_replicate": ("replicate", "wrap"),
    "apply_tp": ("tp", "apply_tp"),
}


def _moved(target: str) -> _deprecation.Deprecated:
    return _deprecation.moved(target, "not part of the public API", __name__)


# Building blocks of the helpers above, public until the API was drawn; where they live is
# internal and may change.
DEPRECATED: dict[str, _deprecation.Deprecated] = {
    "cp_unsupported_reason": _moved("ray_mesh.parallel.cp:cp_unsupported_reason"),
    "find_blocks": _moved("ray_mesh.parallel.fsdp:find_blocks"),
    "gather_over": _moved("ray_mesh.parallel.compose:gather_over"),
    "known_hang": _moved("ray_mesh.parallel.pp.plan:known_hang"),
    "make_style": _moved("ray_mesh.parallel.tp:make_style"),
    "mixed_precision_policy": _moved("ray_mesh.parallel.fsdp:mixed_precision_policy"),
    "PipelinePlan": _moved("ray_mesh.parallel.pp.plan:PipelinePlan"),
    "resolve_mode": _moved("ray_mesh.parallel.fsdp:resolve_mode"),
    "schedule_info": _moved("ray_mesh.parallel.pp.plan:schedule_info"),
    "validate_tp_plan": _moved("ray_mesh.parallel.tp:validate_tp_plan"),
}
"""Deprecated public names of this package (``ray_mesh.core.deprecation``)."""

if TYPE_CHECKING:  # what type checkers, editors and the API reference see
    from ray_mesh.parallel.compose import full_parameters, parallelize
    from ray_mesh.parallel.cp import context_parallel_region
    from ray_mesh.parallel.data import (
        distributed_sampler,
        dp_mean,
        dp_rank,
        dp_size,
        local_batch_size,
        resumable_sampler,
        shard_batch,
    )
    from ray_mesh.parallel.data_position import ResumableSampler
    from ray_mesh.parallel.diloco import DiLoCo
    from ray_mesh.parallel.fsdp import apply_fsdp
    from ray_mesh.parallel.mesh import dim_size, mesh_device, submesh
    from ray_mesh.parallel.picked import layout_of, pick_reason
    from ray_mesh.parallel.pp import Pipeline
    from ray_mesh.parallel.replicate import dp_mode as replicate_dp_mode
    from ray_mesh.parallel.replicate import replicate_config
    from ray_mesh.parallel.replicate import wrap as wrap_replicate
    from ray_mesh.parallel.tp import apply_tp


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        return _deprecation.resolve(__name__, name, DEPRECATED)
    value = getattr(importlib.import_module(f"ray_mesh.parallel.{where[0]}"), where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "DiLoCo",
    "ParallelError",
    "Pipeline",
    "ResumableSampler",
    "apply_fsdp",
    "apply_tp",
    "context_parallel_region",
    "dim_size",
    "distributed_sampler",
    "dp_mean",
    "dp_rank",
    "dp_size",
    "full_parameters",
    "layout_of",
    "local_batch_size",
    "mesh_device",
    "parallelize",
    "pick_reason",
    "replicate_config",
    "replicate_dp_mode",
    "resumable_sampler",
    "shard_batch",
    "submesh",
    "wrap_replicate",
]
