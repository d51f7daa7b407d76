"""Between replica groups of different layouts: a rank's shards as full tensors, and back.

Groups of one layout pair inner rank ``i`` with inner rank ``i`` (:mod:`.link`): the same
shards, so nothing is converted. Unequal boxes make unequal groups: a 2-device node runs
``dp_shard=2``, a 1-device node no sharding, another ``tp=2``. Their ranks hold different
pieces of the same model, so what crosses between them is the *full* state:

1. inside each group, every rank's shards become full tensors
   (:func:`~ray_mesh.parallel.compose.full_tensor`: all-gathers on the group's own, fast,
   intra-node world);
2. across groups only each group's rank 0 (its *leader*) takes part, on the leaders' link;
3. inside the receiving group the leader's result goes to every rank
   (:func:`share_from_leader`), and each rank keeps its own shard of it
   (``distribute_tensor(..., src_data_rank=None)``: a local slice, no communication).

The bytes across groups are the same as in the same-layout case (one copy of each tensor per
group); what is added is an intra-node gather and broadcast.

Step 2 spreads over ``lanes`` ranks when every member group has that many (the quorum's
``Decision.lanes``, the smallest group's rank count): the full tensors, as one float32
buffer, are cut into ``lanes`` slices (:func:`lane_bounds`), rank ``i`` of every group
averages slice ``i`` on its own link (inner rank ``i``'s), and the group's ranks share
their slices (:func:`share_lanes`). Each rank then carries ``1/lanes`` of what crosses,
on a connection and a CPU of its own, instead of the leader carrying it all. A 1-rank
member makes it 1: the leaders' path above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ray_mesh.parallel.compose import full_tensor
from ray_mesh.replicas.flat import by_dtype, flat_by_dtype, scatter_back

EXCHANGES = ("shards", "full")  # same layouts: shard with shard; different: full tensors


def full_like(local: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """An empty tensor of the full shape of ``local`` (a receive buffer)."""
    if isinstance(like, DTensor):
        return torch.empty(like.shape, dtype=local.dtype, device=local.device)
    return torch.empty_like(local)


def to_full(tensors: Sequence[torch.Tensor], likes: Sequence[torch.Tensor | None]
            ) -> list[torch.Tensor]:
    """The full tensors of this rank's shards (a collective on the group's world: every rank
    of the group calls it with the same list).

    The shards of an FSDP group (every DTensor ``Shard(0)`` on one 1-D mesh) go in one
    all-gather per dtype (:func:`_gather_dim0`); any other layout, one gather per tensor.
    Per tensor, a 2-rank group at 0.2 cores a rank took 0.23-0.43 s a step for the LM's
    39 tensors, on the critical path of every boundary (``benchmarks/reshard_gather.py``)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for idx in by_dtype(tensors, _dim0_batch(likes) or []):
        for i, full in zip(idx, _gather_dim0([tensors[i] for i in idx],
                                             [likes[i] for i in idx]), strict=True):
            out[i] = full
    for i, (t, like) in enumerate(zip(tensors, likes, strict=True)):
        if out[i] is not None:
            continue
        if isinstance(like, DTensor):
            dt = DTensor.from_local(t, like.device_mesh, like.placements, run_check=False,
                                    shape=like.shape, stride=like.stride())
            out[i] = full_tensor(dt)
        else:
            out[i] = t
    return out  # type: ignore[return-value]


def _dim0_batch(likes: Sequence[torch.Tensor | None]) -> list[int] | None:
    """The indices of ``likes`` that are DTensors sharded on dim 0 over one 1-D mesh (the
    same mesh for all), or None when there are none or their meshes differ."""
    idx = [i for i, lk in enumerate(likes) if isinstance(lk, DTensor)]
    if not idx:
        return None
    meshes = {id(likes[i].device_mesh) for i in idx}  # type: ignore[union-attr]
    mesh = likes[idx[0]].device_mesh  # type: ignore[union-attr]
    if len(meshes) != 1 or mesh.ndim != 1:
        return None
    picked = [i for i in idx if tuple(likes[i].placements) == (Shard(0),)]  # type: ignore
    return picked or None


def _gather_dim0(locals_: Sequence[torch.Tensor], likes: Sequence[torch.Tensor | None]
                 ) -> list[torch.Tensor]:
    """Full tensors of ``Shard(0)`` shards on one 1-D mesh in one all-gather: each rank's
    shards, each padded to the largest rank's rows (``torch.chunk``'s split, as DTensor
    cuts), go in one flat buffer; each full tensor is the ranks' rows back to back."""
    mesh = likes[0].device_mesh  # type: ignore[union-attr]
    group, size = mesh.get_group(), mesh.size()
    shapes = [tuple(lk.shape) for lk in likes]  # type: ignore[union-attr]
    chunk = [-(-s[0] // size) if s else 0 for s in shapes]  # rows a full chunk holds
    row = [int(torch.Size(s[1:]).numel()) for s in shapes]
    padded = [c * r for c, r in zip(chunk, row, strict=True)]
    device, dtype = locals_[0].device, locals_[0].dtype
    mine = torch.zeros(sum(padded), dtype=dtype, device=device)
    at = 0
    for t, n in zip(locals_, padded, strict=True):
        flat = t.detach().reshape(-1)
        mine[at:at + flat.numel()].copy_(flat)
        at += n
    everyone = torch.empty(size * mine.numel(), dtype=dtype, device=device)
    dist.all_gather_single(everyone, mine, group=group)
    per_rank = everyone.view(size, -1)
    out, at = [], 0
    for s, c, r, n in zip(shapes, chunk, row, padded, strict=True):
        rows = [max(0, min(c, s[0] - k * c)) for k in range(size)]  # rank k's real rows
        parts = [per_rank[k, at:at + rows[k] * r] for k in range(size) if rows[k]]
        out.append(torch.cat(parts).view(s) if parts else torch.empty(s, dtype=dtype,
                                                                      device=device))
        at += n
    return out


def to_local_(dst: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor],
              likes: Sequence[torch.Tensor | None]) -> None:
    """Copy this rank's shard of each full tensor into ``dst`` (its local shards), in place."""
    with torch.no_grad():
        for d, f, like in zip(dst, fulls, likes, strict=True):
            if isinstance(like, DTensor):
                f = distribute_tensor(f.to(d.device), like.device_mesh, like.placements,
                                      src_data_rank=None).to_local()
            d.copy_(f)


def locals_of(fulls: Sequence[torch.Tensor], likes: Sequence[torch.Tensor | None],
              shapes_of: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors: this rank's shard of each full tensor (shaped like ``shapes_of``)."""
    out = [torch.empty_like(s) for s in shapes_of]
    to_local_(out, fulls, likes)
    return out


def _device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def share_from_leader(tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0's ``tensors`` on every rank of this group's world, in place (one broadcast
    per dtype). Every rank calls it with tensors of the same shapes."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    flats = flat_by_dtype(tensors, _device())
    for flat in flats.values():
        dist.broadcast(flat, src=0)
    scatter_back(tensors, flats)


def lane_bounds(n: int, lanes: int, block: int = 1) -> list[tuple[int, int]]:
    """Lane ``i``'s slice ``[lo, hi)`` of a flat buffer of ``n`` values cut over ``lanes``
    ranks in whole ``block``s (int8's scale chunks, so each lane quantizes exactly the
    chunks the whole buffer would have); the last lanes' slices may be empty. The same on
    every member group: it depends on the model's size and the decision only."""
    block, lanes = max(1, block), max(1, lanes)
    blocks = -(-n // block)
    per = -(-blocks // lanes) * block  # whole blocks per lane, rounded up
    return [(min(i * per, n), min((i + 1) * per, n)) for i in range(lanes)]


def share_lanes(flat: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Every lane's slice of ``flat`` (rank ``i`` holds slice ``i``; the other values
    are ignored) on every rank of this group's world: one broadcast per non-empty slice.
    Returns ``flat`` on this group's device."""
    flat = flat.to(_device())
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flat
    for i, (lo, hi) in enumerate(bounds):
        if hi > lo:
            dist.broadcast(flat[lo:hi], src=i)
    return flat


def leader_outcome(ok: bool, total: float) -> tuple[bool, float]:
    """The leader's (ok, total weight) on every rank of the group: the others learn whether
    the cross-group step worked before they wait for its result."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok, total
    box = torch.tensor([1.0 if ok else 0.0, float(total)], dtype=torch.float64,
                       device=_device())
    dist.broadcast(box, src=0)
    return bool(box[0].item() > 0), float(box[1].item())


def all_ranks_agree(ok: bool) -> bool:
    """True when every rank of this group got through the boundary (a MIN over the
    group's own world, which raises if a rank of this group is gone)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_exchange(exchange: str) -> None:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r}: use one of {EXCHANGES} (\"full\" when the "
                         "groups' layouts differ)")
