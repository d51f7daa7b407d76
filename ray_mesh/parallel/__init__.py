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
  :func:`distributed_sampler`, :func:`resumable_sampler` - data (the latter resumes mid-epoch)
- :func:`full_parameters` - the whole parameters back from DTensors (checks, export)
- :func:`submesh`, :func:`dim_size`, :func:`mesh_device` - one dim of the mesh (with an error
  that names the fix when it is missing), its size, this rank's device
- :func:`replicate_config`, :func:`wrap_replicate` - the replicate dim's mode (sync HSDP or
  DiLoCo, :mod:`ray_mesh.parallel.diloco`): the run's settings and the outer loop, or None
- :func:`layout_of`, :func:`pick_reason` - the :class:`~ray_mesh.core.layout.Layout` the
  mesh was built for (``mesh="auto"``'s pick, or the fixed mesh and its replicate mode) and
  why it was picked; ``parallelize`` and the replicate helpers read it off the mesh
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ray_mesh.errors import ParallelError

# Imported on first use (PEP 562), not with the package: the Ray Train backend, the
# controller and the driver import a helper or two from here, and the whole set pulls in
# torch.distributed.tensor and torch.distributed.pipelining (about 1.2 s of imports per
# process, measured on a 2-core machine). The names and what they are stay the same.
_EXPORTS: dict[str, tuple[str, str]] = {
    "full_parameters": ("compose", "full_parameters"),
    "gather_over": ("compose", "gather_over"),
    "parallelize": ("compose", "parallelize"),
    "context_parallel_region": ("cp", "context_parallel_region"),
    "cp_unsupported_reason": ("cp", "cp_unsupported_reason"),
    "distributed_sampler": ("data", "distributed_sampler"),
    "dp_mean": ("data", "dp_mean"),
    "dp_rank": ("data", "dp_rank"),
    "dp_size": ("data", "dp_size"),
    "local_batch_size": ("data", "local_batch_size"),
    "resumable_sampler": ("data", "resumable_sampler"),
    "shard_batch": ("data", "shard_batch"),
    "ResumableSampler": ("data_position", "ResumableSampler"),
    "apply_fsdp": ("fsdp", "apply_fsdp"),
    "find_blocks": ("fsdp", "find_blocks"),
    "mixed_precision_policy": ("fsdp", "mixed_precision_policy"),
    "resolve_mode": ("fsdp", "resolve_mode"),
    "dim_size": ("mesh", "dim_size"),
    "mesh_device": ("mesh", "mesh_device"),
    "submesh": ("mesh", "submesh"),
    "layout_of": ("picked", "layout_of"),
    "pick_reason": ("picked", "pick_reason"),
    "Pipeline": ("pp", "Pipeline"),
    "PipelinePlan": ("pp", "PipelinePlan"),
    "known_hang": ("pp", "known_hang"),
    "schedule_info": ("pp", "schedule_info"),
    "replicate_dp_mode": ("replicate", "dp_mode"),
    "replicate_config": ("replicate", "replicate_config"),
    "wrap_replicate": ("replicate", "wrap"),
    "apply_tp": ("tp", "apply_tp"),
    "make_style": ("tp", "make_style"),
    "validate_tp_plan": ("tp", "validate_tp_plan"),
}

if TYPE_CHECKING:  # what type checkers and editors see
    from ray_mesh.parallel.compose import full_parameters, gather_over, parallelize
    from ray_mesh.parallel.cp import context_parallel_region, cp_unsupported_reason
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
    from ray_mesh.parallel.fsdp import (
        apply_fsdp,
        find_blocks,
        mixed_precision_policy,
        resolve_mode,
    )
    from ray_mesh.parallel.mesh import dim_size, mesh_device, submesh
    from ray_mesh.parallel.picked import layout_of, pick_reason
    from ray_mesh.parallel.pp import Pipeline, PipelinePlan, known_hang, schedule_info
    from ray_mesh.parallel.replicate import dp_mode as replicate_dp_mode
    from ray_mesh.parallel.replicate import replicate_config
    from ray_mesh.parallel.replicate import wrap as wrap_replicate
    from ray_mesh.parallel.tp import apply_tp, make_style, validate_tp_plan


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'ray_mesh.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ray_mesh.parallel.{where[0]}"), where[1])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "ParallelError",
    "Pipeline",
    "PipelinePlan",
    "ResumableSampler",
    "apply_fsdp",
    "apply_tp",
    "context_parallel_region",
    "cp_unsupported_reason",
    "distributed_sampler",
    "dim_size",
    "dp_mean",
    "dp_rank",
    "dp_size",
    "find_blocks",
    "full_parameters",
    "gather_over",
    "known_hang",
    "local_batch_size",
    "make_style",
    "mesh_device",
    "mixed_precision_policy",
    "parallelize",
    "layout_of",
    "pick_reason",
    "replicate_config",
    "replicate_dp_mode",
    "resolve_mode",
    "resumable_sampler",
    "schedule_info",
    "shard_batch",
    "submesh",
    "validate_tp_plan",
    "wrap_replicate",
]
