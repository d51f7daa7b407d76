"""Many tensors as one flat buffer per dtype, and back: one collective per dtype instead of
one per tensor (a model's state is hundreds of tensors; each gloo or NCCL call has a fixed
cost, and across a VPN it is a round trip)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def flat_by_dtype(tensors: Sequence[torch.Tensor], device: str | torch.device = "cpu"
                  ) -> dict[torch.dtype, torch.Tensor]:
    """Each dtype's tensors, detached and concatenated on ``device`` in their order."""
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t.detach().reshape(-1).to(device))
    return {dt: torch.cat(parts) for dt, parts in out.items()}


def scatter_back(tensors: Sequence[torch.Tensor], flats: dict[torch.dtype, torch.Tensor]
                 ) -> None:
    """Copy ``flats`` (as :func:`flat_by_dtype` made them) back into ``tensors``, in place."""
    offsets = dict.fromkeys(flats, 0)
    with torch.no_grad():
        for t in tensors:
            n, o = t.numel(), offsets[t.dtype]
            t.copy_(flats[t.dtype][o:o + n].view_as(t))
            offsets[t.dtype] = o + n
