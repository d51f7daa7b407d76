"""The process groups that cross replica groups: one per inner rank, rebuilt per quorum epoch.

A replica group's own mesh (``dp_shard`` x ``cp`` x ``tp``) lives in its own
``torch.distributed`` world, which dies with the group. What crosses groups cannot live in
that world: when a group goes, the others must keep their mesh. So inner rank ``i`` of every
member group meets the others' inner rank ``i`` in a separate gloo process group, built
directly on a TCP store that outlives the groups (the coordinator hosts it), under a prefix
per epoch: a new member list is a new group, and an old one is never reused. Same-layout
groups pair shard with shard, so a collective moves exactly one copy of each shard.

Gloo, on CPU copies: this link is the slow one (the VPN between nodes), a dead peer shows up
as an error at once (its sockets close) instead of a hang, and ``timeout_s`` bounds the rest
(a peer that vanished without closing anything).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ray_mesh.replicas.flat import flat_by_dtype, scatter_back


class CrossLink:
    """Inner rank ``inner_rank``'s link to the same rank of the other member groups."""

    def __init__(self, host: str, port: int, inner_rank: int, timeout_s: float = 30.0) -> None:
        self.host, self.port, self.inner_rank = host, port, inner_rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroup | None = None
        self._epoch: int | None = None
        self.bytes_received = 0

    def group(self, epoch: int, index: int, size: int) -> dist.ProcessGroup | None:
        """This rank's process group for ``epoch`` (position ``index`` of ``size``
        members); None when it is the only member."""
        if size < 2:
            self._pg, self._epoch = None, epoch
            return None
        if self._epoch != epoch or self._pg is None:
            if self._store is None:
                self._store = dist.TCPStore(self.host, self.port, is_master=False,
                                            timeout=self.timeout)
            prefix = dist.PrefixStore(f"replicas/{epoch}/{self.inner_rank}/", self._store)
            self._pg = dist.ProcessGroupGloo(prefix, index, size, self.timeout)
            self._epoch = epoch
        return self._pg

    def forget(self) -> None:
        """Drop the current group: its sockets close with it, so a peer still in a
        collective on it gets an error at once instead of waiting for ``timeout_s``."""
        self._pg, self._epoch = None, None


def weighted_mean(tensors: Sequence[torch.Tensor], weight: float,
                  group: dist.ProcessGroup | None) -> tuple[list[torch.Tensor], float]:
    """The mean of ``tensors`` over the group, each member weighted by ``weight`` (the
    samples behind its contribution; 0 for a member that contributes nothing), and the
    total weight. New tensors; the inputs are left as they were, so a failed collective
    leaves the caller's contribution intact for the retry."""
    flats = flat_by_dtype(tensors)
    scaled = {dt: f.double() * weight if dt.is_floating_point else f for dt, f in flats.items()}
    total = torch.tensor([float(weight)], dtype=torch.float64)
    if group is not None:
        works = [dist.all_reduce(total, group=group, async_op=True)]
        works += [dist.all_reduce(f, group=group, async_op=True) for f in scaled.values()]
        for w in works:
            w.wait()
    w_all = float(total.item())
    out_flat = {dt: (f / w_all if w_all > 0 else f).to(dt) for dt, f in scaled.items()}
    results = [torch.empty_like(t, device="cpu") for t in tensors]
    scatter_back(results, out_flat)
    return [r.to(t.device) for r, t in zip(results, tensors, strict=True)], w_all


def broadcast_(tensors: Sequence[torch.Tensor], src: int, group: dist.ProcessGroup | None,
               me: int, keep: bool = True) -> int:
    """Overwrite ``tensors`` with member ``src``'s, in place (only with ``keep``: a member
    that takes part without needing the state receives it and drops it); returns the bytes
    that came in (0 on the sender)."""
    if group is None:
        return 0
    flats = flat_by_dtype(tensors)
    opts = dist.BroadcastOptions()  # the group's own method: it is not in c10d's rank table
    opts.rootRank = src
    works = [group.broadcast([f], opts) for f in flats.values()]
    for w in works:
        w.wait()
    if me == src:
        return 0
    if keep:
        scatter_back(tensors, flats)
    return sum(f.numel() * f.element_size() for f in flats.values())


__all__ = ["CrossLink", "broadcast_", "weighted_mean"]
