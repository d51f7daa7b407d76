"""Which data this rank reads: by data-parallel rank, never by world rank.

TP, CP and PP peers must see the same samples (TP ranks hold pieces of one model and
compute one batch together; PP stages pass one batch along), so sharding data by
``dist.get_rank()`` feeds tp peers different samples and silently trains on garbage. The
data-parallel coordinates live on the flattened ``dp`` dim (dp_replicate x dp_shard) that
ray_mesh builds on every mesh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DistributedSampler

from ray_mesh.errors import ParallelError
from ray_mesh.parallel.data_position import ResumableSampler
from ray_mesh.parallel.mesh import MeshOrState, submesh


def _dp(mesh: MeshOrState) -> DeviceMesh:
    """The flattened ``dp`` dim (dp_replicate x dp_shard) that ray_mesh builds on every mesh."""
    return submesh(mesh, "dp")


def dp_rank(mesh: MeshOrState) -> int:
    """This rank's index among the data-parallel replicas (same for its tp/cp/pp peers).

    Stability: stable
    """
    return _dp(mesh).get_local_rank()


def dp_size(mesh: MeshOrState) -> int:
    """How many different batches one step reads (dp_replicate x dp_shard).

    Stability: stable
    """
    return _dp(mesh).size()


def local_batch_size(global_batch: int, mesh: MeshOrState) -> int:
    """The per-replica batch for a global batch, which dp must divide.

    Stability: stable
    """
    size = dp_size(mesh)
    if global_batch % size:
        raise ParallelError(
            f"A global batch of {global_batch} does not split over dp={size} replicas. Use a "
            f"global batch that is a multiple of {size}, e.g. "
            f"{size * max(1, global_batch // size)}."
        )
    return global_batch // size


def shard_batch(batch: Any, mesh: MeshOrState) -> Any:
    """This replica's rows (dim 0) of a global batch: a tensor, or a tuple/list/dict of them.

    Stability: stable
    """
    if isinstance(batch, torch.Tensor):
        per = local_batch_size(batch.shape[0], mesh)
        start = dp_rank(mesh) * per
        return batch[start:start + per]
    if isinstance(batch, tuple | list):
        return type(batch)(shard_batch(b, mesh) for b in batch)
    if isinstance(batch, dict):
        return {k: shard_batch(v, mesh) for k, v in batch.items()}
    raise ParallelError(f"shard_batch: cannot shard a {type(batch).__name__}; pass tensors "
                        f"with the batch on dim 0.")


def dp_mean(value: torch.Tensor, mesh: MeshOrState) -> torch.Tensor:
    """The mean of a per-replica value (e.g. the loss) over the dp replicas, for logging.

    tp/cp/pp peers hold the same value, so only the flattened ``dp`` group is reduced.
    ``value`` is left as it is.

    Stability: stable
    """
    out = value.detach().clone()
    dist.all_reduce(out, group=_dp(mesh).get_group())
    return out / dp_size(mesh)


def distributed_sampler(dataset: Sized, mesh: MeshOrState, **kwargs: Any) -> DistributedSampler:
    """A ``DistributedSampler`` over the dp replicas (kwargs: shuffle, seed, drop_last).

    Stability: stable
    """
    return DistributedSampler(dataset, num_replicas=dp_size(mesh), rank=dp_rank(mesh), **kwargs)


def resumable_sampler(dataset: Sized | int, mesh: MeshOrState,
                      position: Mapping[str, Any] | None = None,
                      **kwargs: Any) -> ResumableSampler:
    """A :class:`ResumableSampler` over the dp replicas, resuming at ``position``.

    ``DistributedSampler``'s order (kwargs: shuffle, seed, drop_last); ``position`` is what
    ``sampler.position()`` returned, e.g. from ``Checkpointer.restore().data_position``. A
    position saved on another dp size resumes too: the rest of the epoch is spread over the
    current dp ranks.

    Stability: experimental
    """
    return ResumableSampler(dataset, num_replicas=dp_size(mesh), rank=dp_rank(mesh),
                            position=position, **kwargs)


__all__ = ["distributed_sampler", "dp_mean", "dp_rank", "dp_size", "local_batch_size",
           "resumable_sampler", "shard_batch"]
