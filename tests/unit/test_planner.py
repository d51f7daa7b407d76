"""The cost model and planner: byte counts against the measured rules, picks, bad inputs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ray_mesh.core.layout import Layout, parse_layout
from ray_mesh.planning.cost import (
    Links,
    ModelStats,
    PlanError,
    Workload,
    candidates,
    predict,
    rank_layouts,
)
from ray_mesh.planning.inputs import PlanInputs

ROOT = Path(__file__).resolve().parents[2]
STATS = ModelStats(params=2_000_000, layers=4, hidden=128, heads=4)
WORK = Workload(tokens=1024, compute_s=2.0)


def links(mbit: float, nodes: int = 2, per_node: int = 2, backend: str = "gloo") -> Links:
    return Links(nodes, per_node, mbit, intra_mbit=20_000, backend=backend)


# The planner's proposals on 2 nodes x 2 workers, in the one layout spelling.
HSDP = "dp_replicate=2,dp_shard=2/fp32/sync"
HSDP_BF16 = "dp_replicate=2,dp_shard=2/bf16/sync"
FSDP = "dp_shard=4/fp32/sync"
PP = "pp=2,dp_shard=2/fp32/sync"


def by_label(ranked):
    """Predictions by their layout's canonical string (which parses back to the layout)."""
    out = {str(p.layout): p for p in ranked}
    assert all(parse_layout(k) == p.layout for k, p in out.items())
    return out


def test_hsdp_crosses_at_the_all_reduce_minimum_and_flat_fsdp_three_times_it_on_gloo():
    preds = by_label(rank_layouts(STATS, links(100), WORK))
    minimum = 2 * (2 - 1) * STATS.params * 4  # all node links together, 2 nodes
    assert preds[HSDP].cross_node_bytes_per_step == pytest.approx(minimum)
    # Measured on the virtual cluster (gloo): flat FSDP moved 3.0x HSDP's bytes.
    ratio = preds[FSDP].cross_node_bytes_per_step / preds[HSDP].cross_node_bytes_per_step
    assert ratio == pytest.approx(3.0)
    # NCCL's reduce-scatter moves half of gloo's (no all-reduce underneath).
    nccl = by_label(rank_layouts(STATS, links(100, backend="nccl"), WORK))
    assert nccl[FSDP].cross_node_bytes_per_step / minimum == pytest.approx(2.25)


def test_bf16_reduce_halves_the_replicate_bytes():
    preds = by_label(rank_layouts(STATS, links(100), WORK))
    assert preds[HSDP_BF16].cross_node_bytes_per_step == pytest.approx(
        preds[HSDP].cross_node_bytes_per_step / 2)


@pytest.mark.parametrize("mbit", [1000, 100, 20])
def test_hsdp_beats_flat_fsdp_and_slower_links_cost_more(mbit):
    preds = by_label(rank_layouts(STATS, links(mbit), WORK))
    assert preds[HSDP].step_s < preds[FSDP].step_s
    slower = by_label(rank_layouts(STATS, links(mbit / 10), WORK))
    assert slower[HSDP].step_s > preds[HSDP].step_s


def test_pipeline_sends_activations_only_and_pays_its_bubble():
    preds = by_label(rank_layouts(STATS, links(20), WORK))
    pp = preds[PP]
    assert pp.cross_node_bytes_per_step == pytest.approx(2 * WORK.tokens * STATS.hidden * 4)
    assert pp.compute_s == pytest.approx(WORK.compute_s / 4 * (4 + 1) / 4)


def test_one_node_has_no_cross_node_traffic():
    for p in rank_layouts(STATS, links(100, nodes=1, per_node=4), WORK):
        assert p.cross_node_bytes_per_step == 0


def test_candidates_respect_heads_and_layers():
    odd = ModelStats(params=1000, layers=1, hidden=30, heads=3)
    names = {c.family for c in candidates(odd, links(100))}
    assert "pp" not in names and not any(n.startswith("tp") for n in names)
    assert {"ddp", "fsdp", "hsdp"} <= names


def test_a_model_too_big_for_any_layout_is_refused_with_the_numbers():
    with pytest.raises(PlanError, match="fits no layout.*GiB per rank"):
        rank_layouts(STATS, links(100), WORK, memory_limit_bytes=1024)


@pytest.mark.parametrize("kw", [{"cross_mbit": 0}, {"cross_mbit": -5}, {"cross_mbit": math.nan},
                                {"cross_mbit": "fast"}, {"nodes": 0}, {"backend": "mpi"}])
def test_bad_links_are_refused(kw):
    base = {"nodes": 2, "per_node": 2, "cross_mbit": 100.0}
    with pytest.raises(PlanError):
        Links(**{**base, **kw})


def test_layout_world_size_must_match():
    with pytest.raises(PlanError, match="ranks"):
        predict(Layout.of({"dp_shard": 3}), STATS, links(100), WORK)


def _load(_ref):
    raise AssertionError("no factory in this test")


@pytest.mark.parametrize("section, match", [
    ({"model": {"params": 10, "layers": 1, "hidden": 8}}, "tokens_per_step is missing"),
    ({"model": {"params": 10, "layers": 1, "hidden": 8}, "tokens_per_step": 0,
      "compute_s": 1}, "tokens_per_step"),
    ({"model": {"params": 10, "layers": 1, "hidden": 8}, "tokens_per_step": 8,
      "compute_s": "soon"}, "compute_s"),
    ({"model": {"params": 10, "layers": 1, "hidden": 8}, "tokens_per_step": 8,
      "compute_s": 1, "link_mbit": 0}, "link_mbit"),
    ({"model": {"params": -1, "layers": 1, "hidden": 8}, "tokens_per_step": 8,
      "compute_s": 1}, "params"),
    ({"model": 5, "tokens_per_step": 8, "compute_s": 1}, "plan.model"),
    ({"model": {"params": 10, "layers": 1, "hidden": 8}, "tokens_per_step": 8,
      "compute_s": 1, "speed": 3}, "unknown key"),
])
def test_bad_plan_sections_name_the_key(section, match):
    with pytest.raises(PlanError, match=match):
        PlanInputs.from_dict(section, _load)


def test_model_stats_from_a_factory_on_the_meta_device():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import fsdp_tp_transformer as ex
    finally:
        sys.path.pop(0)
    cfg = {**ex.DEFAULTS, "dim": 64, "heads": 4, "layers": 3}
    stats = ModelStats.from_module(ex.make_model(cfg), heads=4)
    real = sum(p.numel() for p in ex.make_model(cfg).parameters())
    assert stats.params == real and stats.hidden == 64 and stats.heads == 4


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray_mesh.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_plan_cli_ranks_the_example_job_and_gives_json():
    proc = _cli("plan", "examples/plan_demo.yaml", "--nodes", "2", "--per-node", "2",
                "--link-mbit", "100", "--json", "--import-code")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    steps = [lay["predicted_step_s"] for lay in out["layouts"]]
    assert steps == sorted(steps) and out["pick"] == out["layouts"][0]
    names = [lay["layout"] for lay in out["layouts"]]
    assert names.index(HSDP) < names.index(FSDP)
    for lay in out["layouts"]:
        assert {"mesh", "family", "reduce", "replicate", "predicted_step_s",
                "cross_node_bytes_per_step", "memory_bytes_per_rank"} <= set(lay)
        # the JSON's string and its mapping are the same layout, through the one parser
        mapping = {k: lay[k] for k in ("mesh", "reduce", "pipeline", "replicate")}
        assert parse_layout(lay["layout"]) == parse_layout(mapping)


def test_plan_cli_plans_unequal_nodes_as_one_replica_group_each():
    proc = _cli("plan", "examples/plan_demo.yaml", "--per-node", "2,2,1", "--node-speed",
                "1,1,0.5", "--link-mbit", "100", "--import-code")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "3 node(s) with 2, 2, 1 worker(s)" in out
    assert "node 2: 1 worker(s), layout dp_shard=1, speed 0.5 per device, share 11%" in out
    assert "expected step" in out and "vs equal shares" in out and "nodes 2 left out" in out
    assert "groups='auto', shares='speed'" in out
    js = json.loads(_cli("plan", "examples/plan_demo.yaml", "--per-node", "2,2,1",
                         "--link-mbit", "100", "--import-code", "--json").stdout)
    assert [g["workers"] for g in js["groups"]] == [2, 2, 1] and js["left_out"] == [2]
    bad = _cli("plan", "examples/plan_demo.yaml", "--nodes", "2", "--per-node", "2,2,1",
               "--link-mbit", "100", "--import-code")
    assert bad.returncode == 2 and "one count per node" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_plan_cli_without_a_link_rate_says_how_to_get_one():
    proc = _cli("plan", "examples/plan_demo.yaml", "--nodes", "2", "--per-node", "2",
                "--import-code")
    assert proc.returncode == 2
    assert "--link-mbit" in proc.stderr and "Traceback" not in proc.stderr


def test_job_file_mesh_auto_needs_a_plan_and_carries_it():
    from ray_mesh.cli.job import Job, JobError

    base = {"train": "fsdp_tp_transformer.py:train_loop", "config": {"heads": 4}}
    with pytest.raises(JobError, match="mesh: auto needs a plan"):
        Job.from_dict({**base, "mesh": "auto"}, base_dir=ROOT / "examples")
    with pytest.raises(JobError, match="plan.compute_s"):
        Job.from_dict({**base, "mesh": "auto", "plan": {"model": "fsdp_tp_transformer.py:"
                       "make_model", "tokens_per_step": 64, "compute_s": "soon"}},
                      base_dir=ROOT / "examples")
    job = Job.from_dict({**base, "mesh": "auto", "plan": {
        "model": "fsdp_tp_transformer.py:make_model", "tokens_per_step": 64,
        "compute_s": 0.5, "layouts": ["ddp", "fsdp", "hsdp", "tp_hsdp"]}},
        base_dir=ROOT / "examples")
    assert job.mesh == "auto" and job.plan.stats.heads == 4 and job.plan.work.tokens == 64
    from ray_mesh.cli.runner import mesh_config

    cfg = mesh_config(job)
    assert cfg.mesh == "auto" and cfg.plan is job.plan
