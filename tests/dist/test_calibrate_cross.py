"""``measure_cross`` on 4 gloo ranks as 2 "nodes" of 2 (loopback): it prices a call and a
byte across nodes from real all-reduces (the replicate groups' and one world ring's); a
pipeline's one-way send and an FSDP unit's calls in a node are timed; every rank gets the same
figures, and a world that is one node is refused with the fix. And the in-node pipeline
shape's mesh: its pp groups are a node's consecutive ranks, and a real GPipe step over them
trains."""

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
    from benchmarks.planning_lab.measure import (
        measure_cross,
        measure_pipeline_send,
        measure_unit_collectives,
    )
    from ray_mesh.planning.cost import PlanError

    got = measure_cross(2, 1 << 20, repeats=2)
    got["send_s"] = measure_pipeline_send(2, 1 << 16, repeats=2)
    got["unit_s"] = measure_unit_collectives(2, 1 << 18, ("fp32", "bf16"), repeats=2)
    try:
        measure_cross(4, 1 << 10)
        refused = ""
    except PlanError as exc:
        refused = str(exc)
    pipe = _node_pipeline(rank)
    Path(out, f"{rank}.json").write_text(json.dumps({**got, "refused": refused, **pipe}))
    dist.destroy_process_group()


def _node_pipeline(rank: int) -> dict:
    """A GPipe step on node_pipeline_mesh(2): stage 0 on ranks 0/2, stage 1 on 1/3."""
    import torch
    from torch import nn

    import ray_mesh.parallel  # noqa: F401  (sets the pipeline's parallelize step)
    from benchmarks.planning_lab.measure import node_pipeline_mesh
    from ray_mesh.parallel import Pipeline

    mesh = node_pipeline_mesh(2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 1))
    pipe = Pipeline(model, mesh, loss_fn=nn.functional.mse_loss, n_microbatches=2,
                    schedule="gpipe", dp="none")
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    before = [p.detach().clone() for p in pipe.parameters()]
    loss = pipe.step(x, target=y)
    with torch.no_grad():
        for p in pipe.parameters():
            p -= 0.1 * p.grad
    moved = any(not torch.equal(a, b) for a, b in zip(before, pipe.parameters(), strict=True))
    return {"pp_group": sorted(dist.get_process_group_ranks(mesh.get_group("pp"))),
            "pp_loss": float(loss), "pp_moved": moved}


def test_measure_cross_prices_calls_and_bytes_across_nodes(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, 120, "measure_cross")
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    figures = ("cross_call_s", "cross_Bps", "ring_Bps", "ring_call_s", "send_s", "unit_s",
               "refused")
    assert all({k: s[k] for k in figures} == {k: seen[0][k] for k in figures}
               for s in seen), seen  # medians shared by every rank
    first = seen[0]
    assert 0 < first["cross_call_s"] < 1, first
    assert 1e6 < first["cross_Bps"] < 1e12, first  # loopback: MB/s to GB/s
    assert 1e6 < first["ring_Bps"] < 1e12, first
    assert first["cross_call_s"] <= first["ring_call_s"] < 1, first  # never below a tiny call
    assert "2 or more nodes" in first["refused"], first
    assert 0 < first["send_s"] < 1, first  # 64 KiB one way, the slowest receiver
    # FSDP2's two calls over each node's ranks, the reduce-scatter in both dtypes
    assert set(first["unit_s"]) == {"ag/fp32", "rs/fp32", "rs/bf16"}, first
    assert all(0 < v < 1 for v in first["unit_s"].values()), first
    # pp groups inside the "nodes" {0, 1} and {2, 3}; every stage trained; both pipelines
    # (same seed, same batch) report the same loss
    assert [s["pp_group"] for s in seen] == [[0, 1], [0, 1], [2, 3], [2, 3]], seen
    assert all(s["pp_moved"] for s in seen), seen
    assert len({round(s["pp_loss"], 6) for s in seen}) == 1, seen
