"""``MeshConfig(mesh="auto", plan=PlanInputs(..., step=make_step))`` on local Ray, 4 CPU
workers: at bring-up every worker times the job's step on each candidate mesh, the backend
builds the measured fastest (here not the cost model's first choice: the step makes DDP and
bf16 reduction slow on purpose), and the train function sees that mesh, its precision and
why, on the same world process group the trials used."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.ray


def make_step(mesh, config: dict):
    """The job's step on ``mesh``: a real FSDP2/DDP step, plus an extra wait for the layouts
    this test wants slow (the whole world's replicate dim, or bf16 reduction)."""
    import torch
    from torch import nn

    from ray_mesh.parallel import layout_of, parallelize

    slow = mesh["dp_replicate"].size() > 1 or layout_of(mesh).reduce == "bf16"
    torch.manual_seed(0)
    model = parallelize(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1)), mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def step() -> None:
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        time.sleep(config["extra_s"] if slow else 0.0)
    return step


def train_fn(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    import ray_mesh
    from ray_mesh.parallel import layout_of, pick_reason

    mesh = ray_mesh.get_mesh()
    if dist.get_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump({"mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True)),
                       "precision": layout_of(mesh).precision or "fp32",
                       "layout": str(layout_of()), "why": pick_reason(),
                       "world": dist.get_world_size()}, f)
    ray.train.report({"done": 1})


def test_mesh_auto_times_the_step_and_builds_the_measured_fastest(ray_local, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh
    from ray_mesh.planning.cost import Links, ModelStats, Workload
    from ray_mesh.planning.inputs import PlanInputs

    plan = PlanInputs(ModelStats(params=600, layers=2, hidden=16, heads=4),
                      Workload(tokens=64, compute_s=0.1), precisions=("fp32", "bf16_grads"),
                      step=make_step, step_config={"extra_s": 0.3}, trial_steps=2,
                      trial_budget_s=60)
    # the model's first choice on one node of 4: DDP, which this step makes slow
    assert str(plan.rank(Links(1, 4, 1e5))[0].layout) == "dp_replicate=4/fp32/sync"
    out = tmp_path / "picked.json"
    t0 = time.monotonic()
    TorchTrainer(train_fn, train_loop_config={"out": str(out)},
                 scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
                 torch_config=ray_mesh.MeshConfig(mesh="auto", plan=plan),
                 run_config=RunConfig(name="auto_trial", storage_path=str(tmp_path))).fit()
    print(f"fit with trials: {time.monotonic() - t0:.1f} s")
    got = json.loads(out.read_text())
    assert got["world"] == 4, got
    assert got["mesh"]["dp_shard"] == 4 and got["mesh"]["dp_replicate"] == 1, got
    assert got["precision"] == "fp32", got
    assert got["layout"] == "dp_shard=4/fp32/sync", got  # the mesh's layout is the pick
    assert "measured fastest" in got["why"] and "median of 2 trial steps" in got["why"], got
    assert "the cost model's first choice was dp_replicate=4/fp32/sync" in got["why"], got


def failing_step(mesh, config: dict):
    """A step that breaks on one rank of one layout (flat FSDP): raises, or stalls."""
    import time as _time

    import torch.distributed as dist

    bad = mesh["dp_shard"].size() > 1 and dist.get_rank() == 1

    def step() -> None:
        if bad and config["how"] == "raise":
            raise ValueError("no kernel for this shard shape")
        if bad:
            _time.sleep(config["stall_s"])
    return step


def _fit_auto(tmp_path, name: str, step_config: dict, budget_s: float, bringup_s: float):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh
    from ray_mesh.planning.cost import ModelStats, Workload
    from ray_mesh.planning.inputs import PlanInputs

    plan = PlanInputs(ModelStats(params=600, layers=2, hidden=16, heads=4),
                      Workload(tokens=64, compute_s=0.1), layouts=("ddp", "fsdp"),
                      step=failing_step, step_config=step_config, trial_steps=1,
                      trial_budget_s=budget_s)
    trainer = TorchTrainer(
        train_fn, train_loop_config={"out": str(tmp_path / "never.json")},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        torch_config=ray_mesh.MeshConfig(mesh="auto", plan=plan, bringup_timeout_s=bringup_s),
        run_config=RunConfig(name=name, storage_path=str(tmp_path),
                             failure_config=FailureConfig(max_failures=0)))
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:  # Ray Train wraps the controller's error
        trainer.fit()
    return str(info.value), time.monotonic() - t0


def test_a_failing_trial_step_reaches_the_driver_with_layout_rank_and_fix(ray_local, tmp_path):
    """A step that raises on one rank of one layout fails the fit at once (the other rank is
    left waiting in a collective; the controller does not wait for it), naming the layout,
    the rank, the error and the fix."""
    text, took = _fit_auto(tmp_path, "trial_raises", {"how": "raise"}, 60, 120)
    assert "failed on layout dp_shard=2/fp32/sync" in text and "on rank 1" in text, text
    assert "ValueError: no kernel for this shard shape" in text, text
    assert "leave the layout's family out of plan.layouts" in text, text
    assert not (tmp_path / "never.json").exists()  # the train function never ran
    assert took < 120, took  # the fit ended on the first error, not at the bring-up bound


def test_a_stalled_trial_step_ends_at_the_bound_with_what_to_do(ray_local, tmp_path):
    """A step that stalls on one rank: the controller stops waiting after the trial budget
    plus the bring-up timeout and names the ranks still out and what to change."""
    # Bring-up timeout 2 s (was 4): here it only adds to the trial wait (the mesh bring-up it
    # also bounds never comes). The stall begins when rank 1 starts the flat-FSDP trial, after
    # joining the world group and the DDP trial: ~0.2 s into the wait on an idle machine, and
    # no later than the 2 s trial budget past the join (no layout starts after it), so the
    # 4 s bound leaves ~2 s for the join on a loaded machine; a bound that came first would
    # end the fit with the same message.
    text, took = _fit_auto(tmp_path, "trial_stalls", {"how": "stall", "stall_s": 120}, 2, 2)
    assert "mesh=auto's trial steps did not finish within 4 s" in text, text
    assert "Raise plan.trial_budget_s (now 2 s)" in text, text
    assert "plan.step must do the same collectives on every rank" in text, text
    # bounded: the error at 4 s (the trial budget, 2 s, plus the bring-up timeout, 2 s),
    # then the shutdown's own bounded waits (~8 s here: the stalled worker cannot run the
    # group's teardown), well before the stall would end
    assert took < 100, took
