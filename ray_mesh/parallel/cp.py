"""Context parallel on ``mesh["cp"]``, only where torch's ring attention runs.

torch's ``context_parallel`` shards the sequence of the given buffers over the cp ranks and
swaps ``scaled_dot_product_attention`` for ring attention built on the CUDA flash /
memory-efficient kernels and NCCL. Without them (CPU, gloo) there is no supported path, and
a run that merely skipped the swap would compute attention over its own sequence chunk only:
wrong numbers with no error. So this module refuses such a device up front.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ray_mesh.errors import ParallelError
from ray_mesh.parallel.mesh import MeshOrState, submesh


def cp_unsupported_reason(device_type: str, backend: str) -> str | None:
    """Why context parallel cannot run on this device and backend, or None if it can."""
    if device_type == "cuda" and "nccl" in backend.lower():
        return None
    return (
        f"context parallel (cp > 1) needs CUDA GPUs with the NCCL backend: torch's ring "
        f"attention is built on the CUDA flash/efficient attention kernels; this mesh is on "
        f"{device_type!r} with {backend!r}, where it would give wrong attention or fail. Set "
        f"cp: 1 (give those ranks to dp_shard or tp), or run on GPUs."
    )


def context_parallel_region(
    mesh: MeshOrState,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    no_restore: set[torch.Tensor] | None = None,
) -> contextlib.AbstractContextManager:
    """A context in which ``buffers`` are sharded on their ``seq_dims`` over ``mesh["cp"]``.

    With cp=1 it is a no-op context, so the same training code runs with and without CP.
    Checks, on every rank alike before anything is sharded: the device supports CP, and each
    buffer's sequence splits into 2 * cp equal chunks (torch's load-balanced layout).

    Stability: experimental
    """
    cp_mesh = submesh(mesh, "cp")
    cp = cp_mesh.size()
    if cp == 1:
        return contextlib.nullcontext()
    reason = cp_unsupported_reason(cp_mesh.device_type, str(dist.get_backend(cp_mesh.get_group())))
    if reason:
        raise ParallelError(reason)
    if len(buffers) != len(seq_dims):
        raise ParallelError(f"context parallel: {len(buffers)} buffers but {len(seq_dims)} "
                            f"seq_dims; give one sequence dim per buffer.")
    for i, (buf, dim) in enumerate(zip(buffers, seq_dims, strict=True)):
        if buf.shape[dim] % (2 * cp):
            raise ParallelError(
                f"context parallel: buffer {i} has sequence length {buf.shape[dim]} (dim {dim}), "
                f"which does not split into 2*cp={2 * cp} equal chunks. Pad the sequence to a "
                f"multiple of {2 * cp}."
            )
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(cp_mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims),
                            no_restore_buffers=no_restore)


__all__ = ["context_parallel_region"]
