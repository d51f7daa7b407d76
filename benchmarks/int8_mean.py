"""The CPU side of an int8 exchange between replica groups: the codes of one member's
contribution, then the mean of every member's, as each member computes it.

    python -m benchmarks.int8_mean [--rounds 15] [--members 3] [--cores 0.4] [--out FILE]

An int8 contribution (DiLoCo's pseudo-gradient, or sync's gradients with ``compress:
int8``) is quantized once and, after the all-gather, every member decodes all members'
codes and averages them (``ray_mesh.parallel.compress``). On the lab's small boxes (0.4 of
a core) that CPU time is part of every commit. ``before`` is the code of d923915 (kept
below: an ``|x|`` copy to find each chunk's scale, a new float tensor per member decoded);
``now`` is ``quantize_int8`` and ``mean_int8`` (no ``|x|`` copy; one float buffer reused
for every member, a fused multiply-add). Both sides run in one process on the LM's small
preset's values (``examples/llm.py``, ~1.7M) for ``--members`` members, alternating each
round, first on the machine's CPU, then inside one cgroup capped at ``--cores`` (the lab's
tower: ``harness.netns.cpu``). Each round checks that both give the same codes and means
within float32 rounding. Statistic: the median over rounds (after 2 warm-up rounds) of
each side's wall time; ``ratio`` before / now. Written to ``results.json["int8_mean"]``
with the 1-minute load at the start and end of each setting.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results.json"


def _before_quantize(x, chunk: int):
    """``quantize_int8`` as of d923915."""
    import torch

    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % chunk
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    chunks = flat.view(-1, chunk)
    scales = chunks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(chunks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def _before_mean(codes, scales, n: int, like):
    """``PendingAverage.wait``'s int8 mean as of d923915."""
    import torch

    from ray_mesh.parallel.compress import dequantize_int8

    total = torch.zeros_like(like, dtype=torch.float32)
    for c, s in zip(codes.chunk(n), scales.chunk(n), strict=True):
        total += dequantize_int8(c, s, total)
    return (total / n).to(like.dtype)


def _measure(rounds: int, members: int, out) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    from llm import make_model

    from ray_mesh.parallel.compress import CHUNK, mean_int8, quantize_int8

    torch.set_num_threads(1)
    values = sum(p.numel() for p in make_model().parameters())
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(values, generator=gen) * (i + 1) for i in range(members)]
    sides = {
        "before": (lambda x: _before_quantize(x, CHUNK), _before_mean),
        "now": (quantize_int8, mean_int8),
    }
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds + 2):
        got = {}
        for side, (quantize, mean) in sides.items():
            t0 = time.perf_counter()
            own = quantize(xs[0])
            # the other members' codes, as the all-gather hands them over (not timed: the
            # link's part, the same on both sides)
            t1 = time.perf_counter()
            parts = [own] + [quantize(x) for x in xs[1:]]
            codes = torch.cat([c for c, _ in parts])
            scales = torch.cat([s for _, s in parts])
            t2 = time.perf_counter()
            got[side] = (own[0], mean(codes, scales, members, xs[0]))
            times[side].append((t1 - t0) + (time.perf_counter() - t2))
        assert torch.equal(got["before"][0], got["now"][0])
        assert torch.allclose(got["before"][1], got["now"][1], rtol=1e-6, atol=1e-6)
    out.put({"values": values, **{k: v[2:] for k, v in times.items()}})


def measure(rounds: int, members: int, cores: float | None) -> dict:
    from benchmarks.common import forked, two_sides

    got, load0 = forked(_measure, [(rounds, members)], cores, "rm_int8_mean", 900)
    return {"cores": cores, "members": members, "values": got["values"],
            **two_sides(got, "before", "now", rounds, load0)}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import side_by_side

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--members", type=int, default=3)
    p.add_argument("--cores", type=float, default=0.4)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    side_by_side("int8_mean", args.out,
                 "median over rounds of each side's time: quantizing one member's "
                 "contribution plus the mean of every member's (2 warm-up rounds not counted)",
                 lambda cores: measure(args.rounds, args.members, cores), args.cores,
                 lambda s: f"{s['members']} members of {s['values']} values")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
