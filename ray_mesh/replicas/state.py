"""What a replica group holds, as one ordered list of tensors: to send to a joining group,
and to write as the fallback checkpoint.

Groups of one run share an inner layout, so inner rank ``i`` of one group holds exactly the
shards inner rank ``i`` of another holds: the list is the rank's local shards of the model's
parameters and buffers, then its optimizer's state tensors (parameter by parameter, keys
sorted), then DiLoCo's outer state, then the counters. Both ends build it the same way, so
a broadcast of the list is the whole transfer, and nothing is pickled: the fallback file is
read back with ``torch.load(weights_only=True)`` and checked shape by shape.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ray_mesh.core.files import write_atomic

if TYPE_CHECKING:
    from ray_mesh.parallel.diloco import DiLoCo

COMPLETE = "complete.json"


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is a plain tensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def materialize(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state now (Adam creates it at the first step), so
    that a fresh group and a trained one hold the same list. Takes one step on zero
    gradients, then puts the parameters back and zeroes the state: the next real step is
    then the optimizer's first, as it would have been (step counters start from 0)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    with torch.no_grad():
        saved = [local_of(p).detach().clone() for p in params]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for p, s, g in zip(params, saved, grads, strict=True):
            local_of(p).copy_(s)
            p.grad = g
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    local_of(v).zero_()


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            diloco: DiLoCo | None, counters: torch.Tensor) -> list[torch.Tensor]:
    """This rank's part of the group's state, in the order every group uses (see above)."""
    out = [local_of(p).data for p in model.parameters()]
    out += [local_of(b) for b in model.buffers()]
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            out += [local_of(st[k]) for k in sorted(st) if isinstance(st[k], torch.Tensor)]
    if diloco is not None:
        out += list(diloco.global_params) + list(diloco.momentum)
    out.append(counters)
    return out


def save(path: str | os.PathLike, state: list[torch.Tensor], step: int,
         group: dist.ProcessGroup | None = None, extra: dict[str, Any] | None = None) -> None:
    """Every rank writes its list (whole or absent, `write_atomic`); after a barrier, rank 0
    writes the marker that makes it a checkpoint."""
    path = Path(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    path.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save([t.detach().cpu() for t in state], buf)
    write_atomic(path / f"rank{rank}.pt", buf.getvalue())
    if dist.is_initialized():
        dist.barrier(group)
    if rank == 0:
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        write_atomic(path / COMPLETE, json.dumps({"step": step, "ranks": size,
                                                  **(extra or {})}))
    if dist.is_initialized():
        dist.barrier(group)


def load_into(path: str | os.PathLike, state: list[torch.Tensor],
              group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Read this rank's list from a complete checkpoint into ``state``, in place, refusing a
    file whose tensors do not match (another layout, another model). Returns the marker."""
    path = Path(path)
    marker = json.loads((path / COMPLETE).read_text())
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    saved = torch.load(path / f"rank{rank}.pt", weights_only=True, map_location="cpu")
    if len(saved) != len(state) or any(a.shape != b.shape or a.dtype != b.dtype
                                       for a, b in zip(saved, state, strict=True)):
        raise ValueError(f"{path}: rank {rank}'s state does not match this group's model and "
                         "layout (saved by another model or mesh): start the run from scratch "
                         "or with the layout it was saved with")
    with torch.no_grad():
        for dst, src in zip(state, saved, strict=True):
            dst.copy_(src)
    return marker


__all__ = ["COMPLETE", "load_into", "local_of", "materialize", "save", "tensors"]
