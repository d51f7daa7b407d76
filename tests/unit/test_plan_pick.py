"""``mesh: auto`` picks gradient precision and replicate mode among what the plan allows.

The calibrated step-time model of the benchmarks' laboratory: tests/unit/test_planning_lab.py."""

from __future__ import annotations

import pytest

from ray_mesh.core.layout import parse_layout
from ray_mesh.parallel.diloco import DiLoCoConfig
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
    lay = chosen.layout
    assert lay.replicate == "diloco" and "/diloco:every=50" in str(lay)
    assert isinstance(lay.diloco, DiLoCoConfig) and lay.diloco.every == 50
    assert lay.mesh.dp_replicate == 2
    assert "replicate diloco" in chosen.why  # logged against the sync twin
    assert parse_layout(str(lay)) == lay  # what the workers are told reads back the same
    # the mapping form carries the settings into the prediction and the workers
    chosen = pick(inputs(replicate={"every": 20, "compress": "int8"}), 20)
    assert (chosen.layout.diloco.every, chosen.layout.diloco.compress) == (20, "int8")


def test_bf16_allowed_on_a_slow_link_is_picked():
    for extra in ({"precisions": ["fp32", "bf16_grads"]}, {"bf16_grads": True}):
        chosen = pick(inputs(**extra), 20)
        assert chosen.layout.reduce == "bf16" and "/bf16/" in str(chosen.layout)
        assert chosen.layout.precision == "bf16_grads"
        assert chosen.layout.diloco is None and chosen.layout.replicate == "sync"
        assert "gradient reduction bf16" in chosen.why


def test_nothing_not_allowed_is_ever_picked():
    for mbit in (1, 20, 100, 10_000):
        lay = pick(inputs(), mbit).layout
        assert (lay.reduce, lay.replicate, lay.diloco) == ("fp32", "sync", None)
        assert lay.family in ("hsdp", "fsdp", "ddp")
    # bf16 only: fsdp/hsdp always in bf16 (ddp has no bf16 variant and may stay)
    ranked = inputs(precisions=["bf16_grads"]).rank(Links(2, 2, 20.0))
    assert all(p.layout.reduce == "bf16" or p.layout.family == "ddp" for p in ranked)
    # diloco only (the job's own replicate: section under mesh auto): only DiLoCo layouts,
    # with the job's own settings
    chosen = pick(inputs(), 10_000, DiLoCoConfig(every=10, outer_lr=0.5))
    assert chosen.layout.replicate == "diloco"
    assert chosen.layout.diloco == DiLoCoConfig(every=10, outer_lr=0.5)


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
