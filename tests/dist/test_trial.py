"""``run_trials`` on 4 gloo ranks (2 "nodes" of 2, loopback), the job's step a real FSDP2 /
DDP step with a layout-dependent extra wait: it picks the measured fastest, stops a layout
slower than the best after one step, stops starting layouts past its budget, runs every
layout in its gradient precision, frees each trial mesh's groups, gives every rank the same
result, and names the layout and rank when the step fails on one. The examples' own
``make_step`` (the transformer's pipeline and TP, the LM job's TP + FSDP) run as trials."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from ports import free_port
from torchrun import spawn_ranks

WORLD = 4
ROOT = Path(__file__).resolve().parents[2]
EXTRA_S = {"fsdp": 0.4, "ddp": 0.15, "hsdp": 0.0}  # per step, on top of the real step
HSDP, HSDP_BF16 = "dp_replicate=2,dp_shard=2/fp32/sync", "dp_replicate=2,dp_shard=2/bf16/sync"
FSDP, DDP = "dp_shard=4/fp32/sync", "dp_replicate=4/fp32/sync"
TP, TP_BF16 = "dp_replicate=2,tp=2/fp32/sync", "dp_replicate=2,tp=2/bf16/sync"
PP = "pp=2,dp_shard=2/fp32/sync"


def _family(mesh) -> str:
    names = mesh.mesh_dim_names
    shard = mesh["dp_shard"].size() if "dp_shard" in names else 1
    rep = mesh["dp_replicate"].size() if "dp_replicate" in names else 1
    return "fsdp" if shard == WORLD else "ddp" if rep == WORLD else "hsdp"


def make_step(mesh, config: dict):
    import torch
    from torch import nn

    from ray_mesh.parallel import parallelize
    from ray_mesh.parallel.picked import layout_of

    if "tp" in mesh.mesh_dim_names and mesh["tp"].size() > 1 and config.get("fail_tp"):
        raise ValueError("this model has no tp plan")
    config["seen"].append([_family(mesh), layout_of(mesh).precision or "fp32"])
    torch.manual_seed(0)
    model = parallelize(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1)), mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    extra = EXTRA_S[_family(mesh)]

    def step() -> None:
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        time.sleep(extra)
    return step


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    from torch.distributed.distributed_c10d import _world

    from ray_mesh.core.layout import parse_layout
    from ray_mesh.planning.trial import TrialError, best_trial, run_trials

    lays = [parse_layout(x) for x in (HSDP_BF16, FSDP, DDP, HSDP)]
    groups_before = len(_world.pg_map)
    seen: list = []
    trials = run_trials(lays, make_step, {"seen": seen}, steps=2, budget_s=60)
    groups_after = len(_world.pg_map)
    # a budget spent after the first layout: the others never start
    short = run_trials(lays[1:], make_step, {"seen": []}, steps=3, budget_s=0.01)
    try:
        run_trials([parse_layout(TP)], make_step,
                   {"seen": [], "fail_tp": True}, steps=1)
        failed = ""
    except TrialError as exc:
        failed = str(exc)
    # the examples' own make_step: the transformer's pipeline (pp 2 x FSDP) and TP in bf16,
    # the LM job's TP + FSDP model (tiny preset, short rows)
    sys.path.insert(0, str(ROOT / "examples"))
    import fsdp_tp_transformer
    import llm

    examples = run_trials([parse_layout(PP), parse_layout(TP_BF16)],
                          fsdp_tp_transformer.make_step, {}, steps=1)
    examples += run_trials([parse_layout(TP)],
                           llm.make_step, {"model": {"preset": "tiny"},
                                           "data": {"seq_len": 32, "batch_size": 8}}, steps=1)
    Path(out, f"{rank}.json").write_text(json.dumps({
        "examples": [t.to_json() for t in examples],
        "trials": [t.to_json() for t in trials], "best": best_trial(trials).layout,
        "seen": seen, "groups": [groups_before, groups_after],
        "short": [t.to_json() for t in short], "failed": failed}))
    dist.destroy_process_group()


def test_trials_pick_the_measured_fastest_and_stay_bounded(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, 180, "run_trials")
    seen = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    first = seen[0]
    assert all(s["trials"] == first["trials"] and s["short"] == first["short"]
               for s in seen), seen  # every rank took the same branches, the same numbers
    by = {t["layout"]: t for t in first["trials"]}
    assert [t["layout"] for t in first["trials"]] == [HSDP_BF16, FSDP, DDP, HSDP]
    hsdp_bf16, fsdp, ddp, hsdp = first["trials"]
    # the fast layout ran all its steps; the slow ones stopped after one (slower than it)
    assert hsdp_bf16["status"] == "timed" and len(hsdp_bf16["step_s"]) == 2, by
    assert fsdp["status"] == "cut" and len(fsdp["step_s"]) == 1, by
    assert ddp["status"] == "cut" and len(ddp["step_s"]) == 1, by
    assert fsdp["step_s"][0] >= 0.4 and ddp["step_s"][0] >= 0.15, by  # the slowest rank's
    assert hsdp["status"] in ("timed", "cut"), by  # within noise of hsdp+bf16
    assert first["best"] in (HSDP_BF16, HSDP), first
    # each layout's step was built in its own gradient precision (parallelize followed it)
    assert first["seen"] == [["hsdp", "bf16_grads"], ["fsdp", "fp32"], ["ddp", "fp32"],
                             ["hsdp", "fp32"]], first["seen"]
    # every trial mesh's groups were destroyed: only the world group is left
    assert first["groups"][1] == first["groups"][0], first["groups"]
    assert [t["status"] for t in first["short"]] == ["budget", "budget", "budget"], first
    assert len(first["short"][0]["step_s"]) == 1, first  # the first step crossed the budget
    assert all(TP in s["failed"] and "this model has no tp plan" in s["failed"]
               and "plan.layouts" in s["failed"] for s in seen), [s["failed"] for s in seen]
    assert "on rank 2" in seen[2]["failed"], seen[2]["failed"]
    assert [t["layout"] for t in first["examples"]] == [PP, TP_BF16, TP]
    assert all(len(t["step_s"]) == 1 and t["step_s"][0] > 0 for t in first["examples"]), first
