"""``measure_cross`` on 4 gloo ranks as 2 "nodes" of 2 (loopback): it prices a call and a
byte across nodes from real all-reduces, every rank gets the same figures, and a world that
is one node is refused with the fix."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from ports import free_port
from torchrun import spawn_ranks

WORLD = 4


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    from ray_mesh.planning.calibrate import measure_cross
    from ray_mesh.planning.cost import PlanError

    got = measure_cross(2, 1 << 20, repeats=2)
    try:
        measure_cross(4, 1 << 10)
        refused = ""
    except PlanError as exc:
        refused = str(exc)
    Path(out, f"{rank}.json").write_text(json.dumps({**got, "refused": refused}))
    dist.destroy_process_group()


def test_measure_cross_prices_calls_and_bytes_across_nodes(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, 120, "measure_cross")
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    assert all(s == seen[0] for s in seen), seen  # medians shared by every rank
    first = seen[0]
    assert 0 < first["cross_call_s"] < 1, first
    assert 1e6 < first["cross_Bps"] < 1e12, first  # loopback: MB/s to GB/s
    assert "2 or more nodes" in first["refused"], first
