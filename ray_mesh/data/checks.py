"""A cheap guard that tensor-parallel peers train on the same batch.

TP peers hold pieces of one model and compute one batch together; if a loader splits data
by world rank instead of data-parallel rank, each peer feeds its own rows and the sequence
all-gathers silently mix samples: training runs, the loss even falls a little, and the
model is wrong. Comparing a two-number fingerprint of the batch over the tp group costs one
tiny all-gather and catches it on the first step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ray_mesh.parallel import ParallelError


def fingerprint(tokens: torch.Tensor) -> torch.Tensor:
    """(sum, position-weighted sum) of an integer batch: equal batches give equal pairs."""
    flat = tokens.detach().reshape(-1).to("cpu", torch.int64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64) % 65_521
    return torch.stack([flat.sum(), (flat * weights).sum(), torch.tensor(flat.numel())])


def check_same_batch(tokens: torch.Tensor, mesh: DeviceMesh, *, dim: str = "tp",
                     step: int | None = None) -> None:
    """Raise on every rank of ``mesh[dim]`` unless all of them hold the same ``tokens``."""
    if dim not in (mesh.mesh_dim_names or ()) or mesh[dim].size() == 1:
        return
    sub = mesh[dim]
    mine = fingerprint(tokens)
    group = sub.get_group()
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else \
        torch.device("cpu")
    parts = [torch.zeros_like(mine, device=device) for _ in range(sub.size())]
    dist.all_gather(parts, mine.to(device), group=group)
    if any(not torch.equal(p.cpu(), parts[0].cpu()) for p in parts):
        at = f" at step {step}" if step is not None else ""
        raise ParallelError(
            f"The {sub.size()} {dim} peers of this rank got different batches{at}; they must "
            f"compute on the same rows. The loader splits data by world rank: split it by "
            f"data-parallel rank instead (ray_mesh.parallel.shard_batch / distributed_sampler "
            f"under torchrun; under Ray Train, a dataset split over the mesh's dp dim, not "
            f"Ray's default split over every worker).")
