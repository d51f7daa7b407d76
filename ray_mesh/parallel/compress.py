"""Pseudo-gradient compression for the replicate dim: bf16, or int8 with per-chunk scales.

The DiLoCo outer sync sends one pseudo-gradient per replica over the slow link. Sending it
in bf16 halves the bytes; int8 with one fp32 scale per chunk of :data:`CHUNK` elements
quarters them (plus 4/CHUNK), at an error of at most half a quantisation step per element
(``scale / 2``, ``scale = max|x| / 127`` of its chunk). With error feedback the part lost to
rounding is added to the next sync's pseudo-gradient, so it is delayed, not dropped
(INTELLECT-1 and PRIME's DiLoCo do the same with uint8 buckets).

An int8 sum would overflow, so int8 pseudo-gradients travel by all-gather (each replica's
codes and scales) and are averaged after decoding; with R replicas a rank receives R-1
compressed copies, which on 2 nodes is the same volume as a ring all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ray_mesh.core.diloco_config import COMPRESS_MODES as MODES

CHUNK = 1024


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat int8 codes and per-chunk fp32 scales of ``x`` (any shape, float).

    Few full-size temporaries: each new one costs its page faults as well as its pass (a
    DiLoCo sync quantizes the whole model on a box that may have a fraction of a core).
    """
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % CHUNK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    chunks = flat.view(-1, CHUNK)
    lo, hi = torch.aminmax(chunks, dim=1)  # max |x| of a chunk without an |x| copy
    scales = torch.maximum(hi, lo.neg_()).div_(127.0)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = (chunks / safe[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, like: torch.Tensor
                    ) -> torch.Tensor:
    """The float tensor ``codes``/``scales`` stand for, shaped like ``like``."""
    out = (codes.view(-1, CHUNK).float() * scales[:, None]).view(-1)[: like.numel()]
    return out.view(like.shape).to(like.dtype)


def mean_int8(codes: torch.Tensor, scales: torch.Tensor, n: int, like: torch.Tensor
              ) -> torch.Tensor:
    """The mean of ``n`` members' int8 tensors, gathered one after the other in ``codes``
    and ``scales``, shaped like ``like``: decoded into one float buffer (each member's codes
    through one reused buffer and a fused multiply-add), not a new tensor per member and
    step. The same bytes give the same result on every member."""
    per = codes.view(n, -1, CHUNK)
    step = scales.view(n, -1, 1)
    total = per[0].float().mul_(step[0])
    buf = torch.empty_like(total)
    for i in range(1, n):
        buf.copy_(per[i])
        total.addcmul_(buf, step[i])
    out = total.view(-1)[: like.numel()].div_(n)
    return out.view(like.shape).to(like.dtype)


def wire_bytes(numel: int, mode: str) -> int:
    """Bytes one replica puts on the wire for ``numel`` elements (what the metrics count)."""
    if mode == "bf16":
        return 2 * numel
    if mode == "int8":
        chunks = -(-numel // CHUNK)
        return chunks * CHUNK + 4 * chunks
    return 4 * numel


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    if not isinstance(group, dist.ProcessGroup):
        # A bare backend (the replica groups' gloo link, made outside c10d's table) has no
        # gather into one tensor: gather into views of it.
        return dist.all_gather(list(out.chunk(group.size())), inp, group=group,
                               async_op=True)
    # torch 2.13 names all_gather_into_tensor all_gather_single (same semantics); older
    # releases lack the new name (upstream: torch-all-gather-single-rename).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


def average(x: torch.Tensor, mode: str, group: dist.ProcessGroup) -> torch.Tensor:
    """The mean of ``x`` over ``group``, sent compressed as ``mode`` says (a new tensor)."""
    return start_average(x, mode, group).wait()


def average_and_own(x: torch.Tensor, mode: str, group: dist.ProcessGroup
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`average`, and what this rank's own ``x`` decodes to after compression (``x``
    itself for "none"), for error feedback without quantizing twice."""
    pending = start_average(x, mode, group)
    return pending.wait(), pending.own


class PendingAverage:
    """A compressed average in flight: the collectives run in the process group's own
    threads (``async_op=True``) while the caller goes on; :meth:`wait` blocks until they
    are done and decodes the mean. :attr:`own` (what this rank's input decodes to) is
    known at once, so error feedback need not wait for the link. :attr:`works`: the
    collectives, for a caller that waits on them in its own way first (a bounded wait)."""

    def __init__(self, x: torch.Tensor, mode: str, group: dist.ProcessGroup) -> None:
        if mode not in MODES:
            raise ValueError(f"compression {mode!r}: use one of {MODES}")
        self.mode, self.like, self.n = mode, x, dist.get_world_size(group)
        self._result: torch.Tensor | None = None
        if mode == "none":
            self.own = x
            self._bufs: tuple[torch.Tensor, ...] = (x.detach().clone(),)
            self.works = [dist.all_reduce(self._bufs[0], group=group, async_op=True)]
        elif mode == "bf16":
            out = x.detach().to(torch.bfloat16, copy=True)  # never an alias of the input
            self.own = out.to(x.dtype)
            self._bufs = (out,)
            self.works = [dist.all_reduce(out, group=group, async_op=True)]
        else:
            codes, scales = quantize_int8(x)
            self.own = dequantize_int8(codes, scales, x)
            all_codes = codes.new_empty(self.n * codes.numel())
            all_scales = scales.new_empty(self.n * scales.numel())
            self._bufs = (all_codes, all_scales)
            self.works = [_all_gather(all_codes, codes, group),
                           _all_gather(all_scales, scales, group)]

    def wait(self) -> torch.Tensor:
        """The mean over the group (decoded), once the collectives are done."""
        if self._result is None:
            for work in self.works:
                work.wait()
            x, n = self.like, self.n
            if self.mode == "none":
                self._result = self._bufs[0] / n
            elif self.mode == "bf16":
                self._result = self._bufs[0].to(x.dtype) / n
            else:
                self._result = mean_int8(*self._bufs, n, x)
        return self._result


def start_average(x: torch.Tensor, mode: str, group: dist.ProcessGroup) -> PendingAverage:
    """Start :func:`average` without waiting for it (see :class:`PendingAverage`)."""
    return PendingAverage(x, mode, group)
