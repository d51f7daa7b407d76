"""The wait sampler under torchrun (no Ray, real gloo): a busy rank is named the slow rank.

4 ranks as dp_replicate=2 x dp_shard=2, plain ``dist.all_reduce`` calls (no ray_mesh code on
the training path). Rank 3 spins 80 ms more per step: its peers wait for it in the
collectives, it does not, and :func:`ray_mesh.observability.slow.analyze` names it. Without
a busy rank nothing is named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ray_mesh.observability.slow import RankTimes, analyze

HELPER = Path(__file__).resolve().parents[2] / "harness" / "slow_train.py"


def _run(tmp_path: Path, slow_rank: int | None, **extra) -> list[dict]:
    config = {"out_dir": str(tmp_path), "duration_s": 6, "window_s": 1.5,
              "slow_rank": slow_rank, "busy_s": 0.08, "width": 128, **extra}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(HELPER.parents[1]), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
         str(HELPER), json.dumps(config)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(4)]


def _times(ranks: list[dict]) -> list[RankTimes]:
    """Each rank's windows summed into one, from the second window with a wait on: the ones
    before are bring-up (FSDP2's set-up too), the first one with a wait is partly that."""
    out = []
    for r in ranks:
        first = next((k for k, w in enumerate(r["windows"]) if sum(w["wait_s"].values())),
                     0)
        ws = r["windows"][first + 1:] or r["windows"][first:]
        waits: dict[str, float] = {}
        for w in ws:
            for label, s in w["wait_s"].items():
                waits[label.split("=")[0]] = waits.get(label.split("=")[0], 0.0) + s
        out.append(RankTimes(rank=r["rank"], node=r["node"], coord=r["coord"],
                             window_s=sum(w["window_s"] for w in ws), wait_s=waits,
                             compute_s=sum(w["compute_s"] for w in ws)))
    return out


def test_busy_rank_is_named(tmp_path):
    ranks = _run(tmp_path, slow_rank=3)
    times = _times(ranks)
    result = analyze(times)
    assert result.straggler == 3, (result.verdict, [(t.rank, t.wait_s, t.window_s)
                                                     for t in times])
    assert result.verdict.startswith("slow rank 3"), result.verdict
    # Its dp_shard peer (rank 2) waits for it in dp_shard, where rank 3 hardly waits.
    by_rank = {t.rank: t for t in times}
    assert by_rank[2].share("dp_shard") > by_rank[3].share("dp_shard") + 0.15, by_rank
    assert result.dims["dp_shard"].slowest_rank == 3
    assert result.dims["dp_replicate"].slowest_rank == 3


def test_fsdp2_async_waits_are_seen_and_the_busy_rank_named(tmp_path):
    # FSDP2 (HSDP) issues its collectives asynchronously and waits in work.wait(): the
    # sampler attributes those waits without any code of ours on the path.
    times = _times(_run(tmp_path, slow_rank=1, fsdp=True, steps=50, busy_s=0.1))
    result = analyze(times)
    assert result.straggler == 1, (result.verdict, [(t.rank, t.wait_s, t.window_s)
                                                     for t in times])
    assert all(sum(t.wait_s.values()) > 0 for t in times if t.rank != 1), times


def test_no_busy_rank_no_verdict(tmp_path):
    result = analyze(_times(_run(tmp_path, slow_rank=None)))
    assert result.straggler is None and result.verdict is None, result.verdict
