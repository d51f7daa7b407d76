"""What a replica group holds, as one ordered list of tensors: to send to a joining group,
and to write as the fallback checkpoint (:mod:`.fallback`).

The list is the rank's local shards of the model's parameters and buffers, then its
optimizer's state tensors (parameter by parameter, keys sorted), then DiLoCo's outer state,
then the counters. Every group builds it the same way. Groups of one layout pair inner rank
``i`` with inner rank ``i`` (the same shards), so a broadcast of the list is the whole
transfer; groups of different layouts (:mod:`.reshard`) send the same list as full tensors,
for which :func:`tensors_and_likes` gives each entry's sharding (the fallback checkpoint
saves each entry by that sharding's global shape, so any layout reads it back).

A joining group heals from every group that holds the newest step at once
(:func:`~.link.send_state_`), each sending a part of the list. Only entries that are equal
on every such group may come from different ones (:func:`shared_entries`); the others come
from the first donor, whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from ray_mesh.parallel.diloco import DiLoCo


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


def _entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             diloco: DiLoCo | None, counters: torch.Tensor
             ) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[bool]]:
    """The one walk of a group's state: each entry, its DTensor like, and whether every
    holder of the newest step holds it equal (:func:`shared_entries` says why)."""
    out: list[torch.Tensor] = []
    likes: list[torch.Tensor | None] = []
    shared: list[bool] = []
    sync = diloco is None

    def add(t: torch.Tensor, like: torch.Tensor | None, equal: bool) -> None:
        out.append(local_of(t).data if isinstance(t, torch.nn.Parameter) else local_of(t))
        likes.append(like if isinstance(like, DTensor) else None)
        shared.append(equal)

    for p in model.parameters():
        add(p, p, sync)
    for b in model.buffers():
        add(b, b, False)
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            for k in sorted(st):
                if isinstance(st[k], torch.Tensor):
                    add(st[k], st[k], sync)
    if diloco is not None:
        for i, g in enumerate(diloco.global_params):
            add(g, diloco.params[i], True)
        for i, m in enumerate(diloco.momentum):
            add(m, diloco.params[i], True)
    add(counters, None, True)
    return out, likes, shared


def tensors_and_likes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      diloco: DiLoCo | None, counters: torch.Tensor
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """This rank's part of the group's state, in the order every group uses (see above),
    and for each entry the DTensor whose sharding it has (None: the same whole tensor on
    every rank of the group, e.g. a step counter)."""
    out, likes, _ = _entries(model, optimizer, diloco, counters)
    return out, likes


def tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            diloco: DiLoCo | None, counters: torch.Tensor) -> list[torch.Tensor]:
    """This rank's part of the group's state (:func:`tensors_and_likes` without the likes)."""
    return tensors_and_likes(model, optimizer, diloco, counters)[0]


def shared_entries(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   diloco: DiLoCo | None, counters: torch.Tensor) -> list[bool]:
    """For each entry of :func:`tensors_and_likes` (same walk, same order), True when every
    group that holds the newest step holds it bitwise equal at a boundary, so a healer may
    take it from any of them. Sync groups apply the same decoded average with the same
    optimizer: parameters and optimizer state are equal. DiLoCo groups share only the outer
    state (global parameters, momentum): their parameters at a boundary are their own
    round's and their inner optimizers their own. Buffers (a BatchNorm's running
    statistics) follow each group's own data; the counters are equal by construction."""
    return _entries(model, optimizer, diloco, counters)[2]
