"""What a replica group holds, as one ordered list of tensors: to send to a joining group,
and to write as the fallback checkpoint.

The list is the rank's local shards of the model's parameters and buffers, then its
optimizer's state tensors (parameter by parameter, keys sorted), then DiLoCo's outer state,
then the counters. Every group builds it the same way. Groups of one layout pair inner rank
``i`` with inner rank ``i`` (the same shards), so a broadcast of the list is the whole
transfer; groups of different layouts (:mod:`.reshard`) send the same list as full tensors,
for which :func:`tensors_and_likes` gives each entry's sharding. Nothing is pickled: the
fallback file is read back with ``torch.load(weights_only=True)`` and checked shape by shape.
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
FULL = "full.pt"  # a checkpoint of full tensors (groups of different layouts)


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


def tensors_and_likes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      diloco: DiLoCo | None, counters: torch.Tensor
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """This rank's part of the group's state, in the order every group uses (see above),
    and for each entry the DTensor whose sharding it has (None: the same whole tensor on
    every rank of the group, e.g. a step counter)."""
    out: list[torch.Tensor] = []
    likes: list[torch.Tensor | None] = []

    def add(t: torch.Tensor, like: torch.Tensor | None) -> None:
        out.append(local_of(t).data if isinstance(t, torch.nn.Parameter) else local_of(t))
        likes.append(like if isinstance(like, DTensor) else None)

    for p in model.parameters():
        add(p, p)
    for b in model.buffers():
        add(b, b)
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for k in sorted(st):
                if isinstance(st[k], torch.Tensor):
                    add(st[k], st[k])
    if diloco is not None:
        for i, g in enumerate(diloco.global_params):
            add(g, diloco.params[i])
        for i, m in enumerate(diloco.momentum):
            add(m, diloco.params[i])
    add(counters, None)
    return out, likes


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            diloco: DiLoCo | None, counters: torch.Tensor) -> list[torch.Tensor]:
    """This rank's part of the group's state (:func:`tensors_and_likes` without the likes)."""
    return tensors_and_likes(model, optimizer, diloco, counters)[0]


def save(path: str | os.PathLike, state: list[torch.Tensor], step: int,
         group: dist.ProcessGroup | None = None, extra: dict[str, Any] | None = None,
         full: bool = False) -> None:
    """Every rank writes its list (whole or absent, `write_atomic`); after a barrier, rank 0
    writes the marker that makes it a checkpoint. ``full``: ``state`` is the group's full
    tensors (the same on every rank), written once by rank 0, so that a group of any layout
    can read it back (:mod:`.reshard`)."""
    path = Path(path)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0 or not full:
        buf = io.BytesIO()
        torch.save([t.detach().cpu() for t in state], buf)
        write_atomic(path / (FULL if full else f"rank{rank}.pt"), buf.getvalue())
    extra = {**(extra or {}), **({"full": True} if full else {})}
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
    file whose tensors do not match (another layout, another model). Returns the marker.
    A checkpoint saved ``full`` is read by every rank (``state`` then holds full tensors)."""
    path = Path(path)
    marker = json.loads((path / COMPLETE).read_text())
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    name = FULL if marker.get("full") else f"rank{rank}.pt"
    saved = torch.load(path / name, weights_only=True, map_location="cpu")
    if len(saved) != len(state) or any(a.shape != b.shape or a.dtype != b.dtype
                                       for a, b in zip(saved, state, strict=True)):
        raise ValueError(f"{path}: rank {rank}'s state does not match this group's model and "
                         "layout (saved by another model or mesh): start the run from scratch "
                         "or with the layout it was saved with")
    with torch.no_grad():
        for dst, src in zip(state, saved, strict=True):
            dst.copy_(src)
    return marker


__all__ = ["COMPLETE", "FULL", "load_into", "local_of", "materialize", "save", "tensors",
           "tensors_and_likes"]
