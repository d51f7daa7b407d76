"""Pseudo-gradient compression: int8 within half a step per element, bf16 within its epsilon."""

from __future__ import annotations

import pytest
import torch

from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.errors import ParallelError
from ray_mesh.parallel.compress import (
    CHUNK,
    dequantize_int8,
    mean_int8,
    quantize_int8,
    wire_bytes,
)
from ray_mesh.parallel.diloco.outer import _fragments


@pytest.mark.parametrize("shape", [(7,), (CHUNK,), (3, CHUNK + 5), (64, 33)])
def test_int8_round_trip_within_half_a_step_per_chunk(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    x.view(-1)[0] = 0.0
    codes, scales = quantize_int8(x)
    back = dequantize_int8(codes, scales, x)
    assert back.shape == x.shape and codes.dtype == torch.int8
    flat = torch.nn.functional.pad(x.reshape(-1), (0, (-x.numel()) % CHUNK)).view(-1, CHUNK)
    bound = (flat.abs().amax(1) / 127 / 2).repeat_interleave(CHUNK)[: x.numel()]
    assert torch.all((back - x).reshape(-1).abs() <= bound + 1e-7)


def test_int8_of_zeros_is_zeros():
    x = torch.zeros(10)
    assert torch.equal(dequantize_int8(*quantize_int8(x), x), x)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_int8_mean_of_members_is_the_mean_of_their_decodings(n):
    """What every member computes from the gathered codes (mean_int8, one reused buffer):
    the mean of each member's own decoding, within float32 rounding, shaped and typed like
    the input, and the same bits from the same bytes."""
    like = torch.zeros(3, CHUNK + 5, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(n)
    xs = [torch.randn(like.shape, generator=gen) * (i + 1) for i in range(n)]
    parts = [quantize_int8(x) for x in xs]
    codes = torch.cat([c for c, _ in parts])
    scales = torch.cat([s for _, s in parts])
    want = sum(dequantize_int8(c, s, xs[0]) for c, s in parts) / n
    got = mean_int8(codes, scales, n, like)
    assert got.shape == like.shape and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)
    exact = mean_int8(codes, scales, n, like.float())
    assert torch.allclose(exact, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(exact, mean_int8(codes.clone(), scales.clone(), n, like.float()))


def test_bf16_round_trip_within_its_epsilon():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    back = x.to(torch.bfloat16).float()
    assert torch.all((back - x).abs() <= x.abs() * 2**-8 + 1e-30)


def test_wire_bytes_ratios():
    n = 1 << 20
    assert wire_bytes(n, "bf16") / wire_bytes(n, "none") == 0.5
    assert wire_bytes(n, "int8") / wire_bytes(n, "none") == pytest.approx(0.25, rel=0.01)


def test_fragments_cover_every_parameter_once_in_order():
    frags = _fragments([10, 10, 10, 10, 40], 3)
    assert sorted(i for f in frags for i in f) == list(range(5))
    assert all(f == sorted(f) for f in frags) and len(frags) <= 3


@pytest.mark.parametrize("kw, key", [({"every": 0}, "every"), ({"every": 2.5}, "every"),
                                     ({"outer_lr": 0}, "outer_lr"),
                                     ({"outer_lr": float("nan")}, "outer_lr"),
                                     ({"outer_momentum": 1.0}, "outer_momentum"),
                                     ({"compress": "fp8"}, "compress"),
                                     ({"every": 4, "streaming": 5}, "streaming"),
                                     ({"every": 4, "overlap": 4}, "overlap"),
                                     ({"overlap": -1}, "overlap"),
                                     ({"overlap": True}, "overlap"),
                                     ({"nesterov": "yes"}, "nesterov")])
def test_bad_settings_name_the_key(kw, key):
    with pytest.raises(ParallelError, match=key):
        DiLoCoConfig(**kw)


def test_from_dict_refuses_unknown_keys():
    with pytest.raises(ParallelError, match="unknown key"):
        DiLoCoConfig.from_dict({"mode": "diloco", "evry": 5})
    assert DiLoCoConfig.from_dict({"mode": "diloco", "every": 5}).every == 5
