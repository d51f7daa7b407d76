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
from torch.distributed.tensor import DTensor, distribute_tensor

from ray_mesh.parallel.compose import full_tensor
from ray_mesh.replicas.flat import flat_by_dtype, scatter_back

EXCHANGES = ("shards", "full")  # same layouts: shard with shard; different: full tensors


def full_like(local: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """An empty tensor of the full shape of ``local`` (a receive buffer)."""
    if isinstance(like, DTensor):
        return torch.empty(like.shape, dtype=local.dtype, device=local.device)
    return torch.empty_like(local)


def to_full(tensors: Sequence[torch.Tensor], likes: Sequence[torch.Tensor | None]
            ) -> list[torch.Tensor]:
    """The full tensors of this rank's shards (a collective on the group's world: every rank
    of the group calls it with the same list)."""
    out = []
    for t, like in zip(tensors, likes, strict=True):
        if isinstance(like, DTensor):
            dt = DTensor.from_local(t, like.device_mesh, like.placements, run_check=False,
                                    shape=like.shape, stride=like.stride())
            out.append(full_tensor(dt))
        else:
            out.append(t)
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
