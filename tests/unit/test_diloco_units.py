"""Replicate mode on the driver (job section, MeshConfig) and DiLoCo in the cost model."""

from __future__ import annotations

import pytest

from ray_mesh.cli.job import Job, JobError
from ray_mesh.core.layout import Layout
from ray_mesh.parallel.diloco import DiLoCoConfig
from ray_mesh.parallel.replicate import parse_replicate
from ray_mesh.planning.cost import (
    Links,
    ModelStats,
    PlanError,
    Workload,
    candidates,
    diloco_sync_bytes,
    predict,
    rank_layouts,
)
from ray_mesh.planning.inputs import PlanInputs

STATS = ModelStats(params=10_000_000, layers=4, hidden=256, heads=4)
LINKS = Links(nodes=2, per_node=2, cross_mbit=20.0)
WORK = Workload(tokens=4096, compute_s=4.0)
HSDP = {"dp_replicate": 2, "dp_shard": 2}


def _job(replicate, mesh="hsdp"):
    return Job.from_dict({"train": "x.py:f", "mesh": mesh, "replicate": replicate})


def test_replicate_section_parsed():
    job = _job({"mode": "diloco", "every": 50, "outer_lr": 0.7, "outer_momentum": 0.9,
                "compress": "int8", "streaming": 4})
    assert job.replicate == DiLoCoConfig(every=50, compress="int8", streaming=4)
    assert _job(None).replicate is None
    assert _job({"mode": "sync"}).replicate is None
    assert _job("diloco").replicate == DiLoCoConfig()
    assert _job({"mode": "diloco"}, {"dp_replicate": 2, "dp_shard": 2}).replicate.every == 50


@pytest.mark.parametrize(("replicate", "mesh", "match"), [
    ({"mode": "diloco", "every": 0}, "hsdp", "replicate.every=0"),
    ({"mode": "dilco"}, "hsdp", "use 'sync'"),
    ({"every": 5}, "hsdp", "only apply to mode: diloco"),
    ({"mode": "diloco", "compres": "int8"}, "hsdp", "unknown key"),
    ({"mode": "diloco", "compress": "fp8"}, "hsdp", "replicate.compress"),
    ({"mode": "diloco", "every": 4, "streaming": 8}, "hsdp", "replicate.streaming"),
    ({"mode": "diloco"}, "fsdp", "dp_replicate: nodes"),
    ({"mode": "diloco"}, {"dp_replicate": 1, "dp_shard": 4}, "dp_replicate=1"),
    ([1, 2], "hsdp", "must be a mapping"),
])
def test_replicate_section_errors(replicate, mesh, match):
    with pytest.raises(JobError, match=match):
        _job(replicate, mesh)


def test_meshconfig_carries_replicate():
    from ray_mesh.raytrain.backend import MeshConfig

    cfg = MeshConfig(mesh=HSDP, replicate={"mode": "diloco", "every": 8, "compress": "bf16"})
    assert cfg.replicate == DiLoCoConfig(every=8, compress="bf16")
    assert cfg.to_dict()["replicate"]["every"] == 8
    assert MeshConfig(mesh=HSDP).replicate is None
    with pytest.raises(ValueError, match="dp_replicate"):
        MeshConfig(mesh="fsdp", replicate="diloco")
    assert parse_replicate(DiLoCoConfig(every=3)).every == 3


def test_diloco_cross_bytes_are_sync_over_h_times_ratio():
    sync = predict(Layout.of(HSDP), STATS, LINKS, WORK)
    for compress, ratio in (("none", 1.0), ("bf16", 0.5), ("int8", 0.25 * (1 + 4 / 1024))):
        dl = predict(Layout.of(HSDP, diloco=DiLoCoConfig(every=50, compress=compress)), STATS,
                     LINKS, WORK)
        assert dl.cross_node_bytes_per_step == pytest.approx(
            sync.cross_node_bytes_per_step / 50 * ratio), compress
        assert dl.cross_s < sync.cross_s / 50 * 1.01
        assert dl.memory_bytes_per_rank > sync.memory_bytes_per_rank  # outer state
    # on 2 replicas the int8 all-gather moves the same as an all-reduce of a quarter size
    assert diloco_sync_bytes(2, 4000.0, "int8") == pytest.approx(1000 * (1 + 4 / 1024))
    assert diloco_sync_bytes(4, 4000.0, "none") == pytest.approx(6000.0)


def test_diloco_layouts_listed_and_win_on_a_slow_link():
    int8 = DiLoCoConfig(every=50, compress="int8")
    lays = candidates(STATS, LINKS, ("hsdp", "tp_hsdp", "fsdp"), bf16=False, diloco=int8)
    labels = [str(lay) for lay in lays]
    assert "dp_replicate=2,dp_shard=2/fp32/diloco:every=50,compress=int8" in labels
    assert "dp_replicate=2,tp=2/fp32/diloco:every=50,compress=int8" in labels
    assert not any(lay.diloco for lay in lays if lay.family == "fsdp")  # no replicate dim
    ranked = rank_layouts(STATS, LINKS, WORK, families=("hsdp", "fsdp"), bf16=False,
                          diloco=int8)
    assert ranked[0].layout.diloco == int8
    assert ranked[0].to_json()["replicate"] == {"mode": "diloco", **vars(int8)}
    # without plan.replicate nothing changes
    assert all(p.layout.diloco is None for p in rank_layouts(STATS, LINKS, WORK))
    # one node: no replicate dim, no DiLoCo layout
    one = Links(nodes=1, per_node=4, cross_mbit=20.0)
    assert not any(lay.diloco for lay in candidates(STATS, one, diloco=DiLoCoConfig()))


def test_plan_replicate_section():
    base = {"model": {"params": 1000, "layers": 2, "hidden": 8}, "tokens_per_step": 64,
            "compute_s": 1.0}
    inputs = PlanInputs.from_dict({**base, "replicate": {"every": 20, "compress": "bf16"}},
                                  load_factory=lambda ref: None)
    assert inputs.diloco == DiLoCoConfig(every=20, compress="bf16")
    assert PlanInputs.from_dict(base, load_factory=lambda ref: None).diloco is None
    for bad, match in (({"every": 0}, "every"), ({"compress": "zip"}, "compress"),
                       ({"evry": 3}, "plan.replicate"), ({"mode": "sync"}, "only diloco")):
        with pytest.raises(PlanError, match=match):
            PlanInputs.from_dict({**base, "replicate": bad}, load_factory=lambda ref: None)


def test_benchmark_plot_and_table(tmp_path):
    from benchmarks import diloco
    from benchmarks.report import table

    sec = {"every": 10, "compress": "int8", "unshaped_tokens_s": 900.0,
           "diloco_tokens_s": 800.0, "sync_tokens_s": 300.0, "diloco_val_loss": 1.2,
           "sync_val_loss": 1.1, "diloco_cross_node_bytes_per_step": 1e5,
           "sync_cross_node_bytes_per_step": 2e6, "diloco_losses": [3.0, 2.0, 1.5],
           "sync_losses": [3.0, 1.8, 1.2]}
    path = diloco.plot({"20mbit": sec}, tmp_path / "loss.png")
    assert path.exists() and path.stat().st_size > 100
    rows = [r for r in table({"diloco": {"20mbit": sec}}) if r[0] == "h diloco"]
    assert len(rows) == 3 and "800 / 300 / 900" in rows[0][2], rows
    assert diloco.rate_key(None) == "unshaped" and diloco.rate_key(20) == "20mbit"


def test_benchmark_lm_job_batches_and_target_checks():
    import torch

    from benchmarks import diloco
    from benchmarks import diloco_lm as lm

    cfg = {**lm.DEFAULTS, "max_tokens": 50_000, "val_tokens": 4096, "batch_size": 4,
           "steps": 20}
    x, y = lm.batch(3, cfg)
    assert x.shape == (4, 128) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(lm.batch(3, cfg)[0], x)  # a step's batch depends on the step alone
    assert not torch.equal(lm.batch(4, cfg)[0], x)
    train = {tuple(r.tolist()) for r in lm.rows(cfg, "train")}
    vx, vy = lm.val_batch(0, cfg)
    rows = torch.cat([vx, vy[:, -1:]], dim=1)
    assert not any(tuple(r.tolist()) in train for r in rows)  # held-out files only
    with pytest.raises(ValueError, match="val_tokens"):
        lm.val_batch(10_000, cfg)
    assert lm.lr_factor(0, cfg) == pytest.approx(1 / cfg["warmup"])
    assert lm.lr_factor(20, cfg) == pytest.approx(cfg["min_lr_ratio"])
    assert lm.lr_factor(10, cfg) == pytest.approx(1.0)
    loss = lm.loss_fn(lm.make_model(cfg)(x), y)
    assert 4.5 < loss.item() < 6.5  # ~ln(256) at init

    sec = {"unshaped_tokens_s": 1000.0, "diloco_tokens_s": 950.0, "sync_tokens_s": 300.0,
           "diloco_val_loss": 2.46, "sync_val_loss": 2.40,
           "diloco_cross_node_bytes_per_step": 1e5, "sync_cross_node_bytes_per_step": 3.6e6}
    c = diloco.checks(sec, 10, "int8")
    assert c["diloco_over_unshaped_met"] and c["diloco_over_sync_met"] and c["val_loss_met"]
    assert not c["bytes_met"] and c["bytes_bound_per_step"] == pytest.approx(3.6e5 * 0.251,
                                                                               rel=1e-3)
    assert not diloco.checks({**sec, "diloco_val_loss": 2.5}, 10, "int8")["val_loss_met"]
