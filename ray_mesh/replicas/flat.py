"""Many tensors as one flat buffer per dtype, and back: one collective per dtype instead of
one per tensor (a model's state is hundreds of tensors; each gloo or NCCL call has a fixed
cost, and across a VPN it is a round trip)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def by_dtype(tensors: Sequence[torch.Tensor], picked: Iterable[int]) -> list[list[int]]:
    """``picked`` (indices of ``tensors``) grouped by dtype, in the order each dtype first
    appears: the same on every rank, so the ranks' collectives pair up (a set of dtypes is
    ordered by their hashes, which are addresses and differ between processes)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i in picked:
        groups.setdefault(tensors[i].dtype, []).append(i)
    return list(groups.values())


def flat_by_dtype(tensors: Sequence[torch.Tensor], device: str | torch.device = "cpu"
                  ) -> dict[torch.dtype, torch.Tensor]:
    """Each dtype's tensors, detached and concatenated on ``device`` in their order; the
    dtypes in :func:`by_dtype`'s order."""
    return {tensors[idx[0]].dtype: torch.cat([tensors[i].detach().reshape(-1).to(device)
                                              for i in idx])
            for idx in by_dtype(tensors, range(len(tensors)))}


def scatter_back(tensors: Sequence[torch.Tensor], flats: dict[torch.dtype, torch.Tensor]
                 ) -> None:
    """Copy ``flats`` (as :func:`flat_by_dtype` made them) back into ``tensors``, in place."""
    offsets = dict.fromkeys(flats, 0)
    with torch.no_grad():
        for t in tensors:
            n, o = t.numel(), offsets[t.dtype]
            t.copy_(flats[t.dtype][o:o + n].view_as(t))
            offsets[t.dtype] = o + n
