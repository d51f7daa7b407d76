"""The slices of a full-tensor exchange spread over a group's ranks (ray_mesh.replicas.reshard:
``lane_bounds``): every value in exactly one lane, lanes in whole int8 chunks, the same cut
for every member. The exchange itself, on real gloo links between groups of different
layouts: tests/dist/test_replica_layouts.py."""

from __future__ import annotations

import pytest
import torch

from ray_mesh.parallel.compress import CHUNK, dequantize_int8, quantize_int8
from ray_mesh.replicas.reshard import lane_bounds


@pytest.mark.parametrize("n, lanes, block", [(1608, 2, 1), (1608, 2, CHUNK), (10, 4, 1),
                                             (5000, 3, CHUNK), (1, 2, CHUNK), (0, 2, 1),
                                             (7, 1, 1)])
def test_lanes_cover_every_value_once_in_whole_blocks(n, lanes, block):
    bounds = lane_bounds(n, lanes, block)
    assert len(bounds) == lanes
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (lo, hi), (nxt, _) in zip(bounds, bounds[1:], strict=False):
        assert lo <= hi == nxt  # contiguous, in order, no overlap
    for lo, _ in bounds:
        assert lo % block == 0 or lo == n  # a lane starts on a chunk boundary
    if n:
        assert bounds[0][1] > 0  # lane 0 (the leader) always has a slice
    # no lane more than its fair part rounded up to a whole block
    assert all(hi - lo <= -(-n // lanes) + block for lo, hi in bounds), bounds


def test_int8_lanes_quantize_the_chunks_the_whole_buffer_would():
    """Cut at chunk boundaries, each lane's int8 codes and scales are the whole buffer's:
    a spread exchange decodes to exactly what the leaders' one would."""
    torch.manual_seed(0)
    x = torch.randn(5000) * torch.linspace(0.1, 10, 5000)
    whole = dequantize_int8(*quantize_int8(x), x)
    parts = [dequantize_int8(*quantize_int8(x[lo:hi]), x[lo:hi])
             for lo, hi in lane_bounds(x.numel(), 3, CHUNK) if hi > lo]
    assert torch.equal(torch.cat(parts), whole)


def test_a_gather_per_dtype_goes_in_the_order_the_dtypes_first_appear():
    """Every rank must issue the per-dtype gathers in one order: first appearance, not a
    set's (torch.dtype hashes by address, which differs between worker processes)."""
    from ray_mesh.replicas.flat import by_dtype

    ts = [torch.zeros(1, dtype=d) for d in
          (torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.float32)]
    assert by_dtype(ts, range(5)) == [[0, 2], [1, 4], [3]]
    assert by_dtype(ts, [4, 3, 0]) == [[4], [3], [0]]
    assert by_dtype(ts, []) == []
