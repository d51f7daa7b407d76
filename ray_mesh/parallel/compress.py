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

CHUNK = 1024
MODES = ("none", "bf16", "int8")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat int8 codes and per-chunk fp32 scales of ``x`` (any shape, float)."""
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % CHUNK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    chunks = flat.view(-1, CHUNK)
    scales = chunks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(chunks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, like: torch.Tensor
                    ) -> torch.Tensor:
    """The float tensor ``codes``/``scales`` stand for, shaped like ``like``."""
    out = (codes.view(-1, CHUNK).float() * scales[:, None]).view(-1)[: like.numel()]
    return out.view(like.shape).to(like.dtype)


def wire_bytes(numel: int, mode: str) -> int:
    """Bytes one replica puts on the wire for ``numel`` elements (what the metrics count)."""
    if mode == "bf16":
        return 2 * numel
    if mode == "int8":
        chunks = -(-numel // CHUNK)
        return chunks * CHUNK + 4 * chunks
    return 4 * numel


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (same semantics); older releases lack the new name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def average(x: torch.Tensor, mode: str, group: dist.ProcessGroup) -> torch.Tensor:
    """The mean of ``x`` over ``group``, sent compressed as ``mode`` says (a new tensor)."""
    return average_and_own(x, mode, group)[0]


def average_and_own(x: torch.Tensor, mode: str, group: dist.ProcessGroup
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`average`, and what this rank's own ``x`` decodes to after compression (``x``
    itself for "none"), for error feedback without quantizing twice."""
    n = dist.get_world_size(group)
    if mode == "none":
        out = x.detach().clone()
        dist.all_reduce(out, group=group)
        return out / n, x
    if mode == "bf16":
        out = x.detach().to(torch.bfloat16)
        own = out.to(x.dtype, copy=True)  # all_reduce overwrites out
        dist.all_reduce(out, group=group)
        return out.to(x.dtype) / n, own
    if mode != "int8":
        raise ValueError(f"compression {mode!r}: use one of {MODES}")
    codes, scales = quantize_int8(x)
    all_codes = codes.new_empty(n * codes.numel())
    all_scales = scales.new_empty(n * scales.numel())
    _all_gather(all_codes, codes, group)
    _all_gather(all_scales, scales, group)
    total = torch.zeros_like(x, dtype=torch.float32)
    for c, s in zip(all_codes.chunk(n), all_scales.chunk(n), strict=True):
        total += dequantize_int8(c, s, total)
    return (total / n).to(x.dtype), dequantize_int8(codes, scales, x)


__all__ = ["CHUNK", "MODES", "average", "average_and_own", "dequantize_int8", "quantize_int8",
           "wire_bytes"]
