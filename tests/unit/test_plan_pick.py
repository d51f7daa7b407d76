"""``mesh: auto`` picks gradient precision and replicate mode among what the plan allows.

The calibrated step-time model of the benchmarks' laboratory: tests/unit/test_planning_lab.py."""

from __future__ import annotations

import pytest

from ray_mesh.parallel.diloco import DiLoCoConfig
from ray_mesh.parallel.picked import PickedPlan, picked_precision, set_picked_plan
from ray_mesh.planning.cost import Links, ModelStats, PlanError, Workload
from ray_mesh.planning.inputs import PlanInputs
from ray_mesh.raytrain.links import pick_mesh

STATS = ModelStats(params=10_000_000, layers=4, hidden=256, heads=4)
WORK = Workload(tokens=4096, compute_s=4.0)
BASE = {"model": {"params": 10_000_000, "layers": 4, "hidden": 256, "heads": 4},
        "tokens_per_step": 4096, "compute_s": 4.0, "layouts": ["hsdp", "fsdp", "ddp"]}


def inputs(**extra) -> PlanInputs:
    return PlanInputs.from_dict({**BASE, **extra}, load_factory=lambda ref: None)


def pick(plan: PlanInputs, mbit: float, replicate: DiLoCoConfig | None = None):
    return pick_mesh(plan, 2, 2, None, "gloo", replicate) if mbit is None else pick_mesh(
        PlanInputs(**{**plan.__dict__, "link_mbit": mbit}), 2, 2, None, "gloo", replicate)


def test_diloco_allowed_on_a_slow_link_is_picked_and_handed_to_the_workers():
    chosen = pick(inputs(replicate=["sync", "diloco"]), 20)
    assert chosen.plan.replicate == "diloco" and "diloco" in chosen.plan.layout
    assert isinstance(chosen.replicate, DiLoCoConfig) and chosen.replicate.every == 50
    assert chosen.spec.dp_replicate == 2
    assert "replicate diloco" in chosen.plan.why  # logged against the sync twin
    # the mapping form carries the settings into the prediction and the workers
    chosen = pick(inputs(replicate={"every": 20, "compress": "int8"}), 20)
    assert (chosen.replicate.every, chosen.replicate.compress) == (20, "int8")


def test_bf16_allowed_on_a_slow_link_is_picked():
    for extra in ({"precisions": ["fp32", "bf16_grads"]}, {"bf16_grads": True}):
        chosen = pick(inputs(**extra), 20)
        assert chosen.plan.precision == "bf16_grads" and chosen.plan.layout.endswith("+bf16")
        assert chosen.replicate is None and chosen.plan.replicate == "sync"
        assert "gradient reduction bf16" in chosen.plan.why


def test_nothing_not_allowed_is_ever_picked():
    for mbit in (1, 20, 100, 10_000):
        chosen = pick(inputs(), mbit)
        assert (chosen.plan.precision, chosen.plan.replicate, chosen.replicate) == (
            "fp32", "sync", None)
        assert chosen.plan.layout in ("hsdp", "fsdp", "ddp")
    # bf16 only: fsdp/hsdp always in bf16 (ddp has no bf16 variant and may stay)
    ranked = inputs(precisions=["bf16_grads"]).rank(Links(2, 2, 20.0))
    assert all(p.layout.reduce == "bf16" or p.layout.name == "ddp" for p in ranked)
    # diloco only (the job's own replicate: section under mesh auto): only DiLoCo layouts
    chosen = pick(inputs(), 10_000, DiLoCoConfig(every=10))
    assert chosen.plan.replicate == "diloco" and chosen.replicate.every == 10


@pytest.mark.parametrize("extra, match", [
    ({"precisions": ["fp16"]}, "plan.precisions"),
    ({"precisions": []}, "plan.precisions"),
    ({"precisions": "bf16_grads"}, "plan.precisions"),
    ({"replicate": ["async"]}, "plan.replicate"),
    ({"replicate": []}, "plan.replicate"),
])
def test_bad_allowed_lists_name_the_key(extra, match):
    with pytest.raises(PlanError, match=match):
        inputs(**extra)


def test_apply_fsdp_default_precision_follows_the_pick():
    try:
        set_picked_plan(PickedPlan("hsdp+bf16", {"dp_replicate": 2, "dp_shard": 2},
                                   "bf16_grads"))
        assert picked_precision() == "bf16_grads"
        set_picked_plan(PickedPlan("hsdp", {"dp_replicate": 2, "dp_shard": 2}))
        assert picked_precision() is None
    finally:
        set_picked_plan(None)
    assert picked_precision() is None
