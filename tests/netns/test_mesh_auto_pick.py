"""``MeshConfig(mesh="auto")`` picks DiLoCo by itself when the plan allows it and the link
is slow, and a train function written with the replicate helpers runs it (real Ray, 2 x 2
workers on the virtual cluster, node links shaped to 20 Mbit/s)."""

from __future__ import annotations

import json
import textwrap

import pytest

from harness.netns import NetnsCluster, netns_unavailable_reason

pytestmark = [pytest.mark.netns, pytest.mark.ray]

DRIVER = textwrap.dedent("""\
    import json, os, sys
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    import ray_mesh
    from ray_mesh.planning.inputs import PlanInputs

    def train_fn(config):
        import torch
        import torch.distributed as dist
        from ray_mesh.parallel import (layout_of, parallelize, replicate_config,
                                       replicate_dp_mode, wrap_replicate)
        mesh = ray_mesh.get_mesh()
        torch.manual_seed(0)
        model = parallelize(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)),
                            mesh, dp=replicate_dp_mode())
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        dl = wrap_replicate(model, mesh)  # None in sync mode
        x = torch.randn(8, 16)
        for _ in range(4):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            if dl:
                dl.step()
        if dist.get_rank() == 0:
            cfg, picked = replicate_config(), layout_of(mesh)
            with open(config["out"], "w") as f:
                json.dump({"mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)),
                           "mode": "diloco" if cfg else "sync",
                           "every": cfg.every if cfg else None,
                           "dp_mode": replicate_dp_mode(),
                           "outer_steps": dl.outer_steps if dl else 0,
                           "picked": str(picked), "precision": picked.reduce}, f)
        ray.train.report({"done": 1})

    ray.init()
    out = sys.argv[1]
    plan = PlanInputs.from_dict({
        "model": {"params": 3_000_000, "layers": 4, "hidden": 256, "heads": 4},
        "tokens_per_step": 1024, "compute_s": 2.0, "layouts": ["hsdp", "fsdp", "ddp"],
        "replicate": {"every": 2, "compress": "none"}}, load_factory=None)
    TorchTrainer(train_fn, train_loop_config={"out": out},
                 scaling_config=ScalingConfig(num_workers=4,
                                              resources_per_worker={"CPU": 0.5, "slot": 1}),
                 torch_config=ray_mesh.MeshConfig(mesh="auto", plan=plan, measure_links=True),
                 run_config=RunConfig(name="auto_pick", storage_path=os.path.dirname(out))).fit()
""")


@pytest.mark.slow  # ~90 s with its cluster; the pick itself is tests/unit/test_plan_pick.py
def test_mesh_auto_runs_diloco_when_allowed_on_a_slow_link(tmp_path):
    if reason := netns_unavailable_reason():
        pytest.skip(reason)
    with NetnsCluster([{"slot": 2}, {"slot": 2}], link_mbit=20) as cluster:
        out = cluster.root / "results" / "pick.json"
        out.parent.mkdir()
        script = cluster.root / "auto_pick_driver.py"
        script.write_text(DRIVER)
        proc = cluster.run_in(0, ["python", str(script), str(out)], timeout=500,
                              env={"RAY_ADDRESS": cluster.address, "PYTHONUNBUFFERED": "1"})
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        seen = json.loads(out.read_text())
    assert seen["mesh"]["dp_replicate"] == 2 and seen["mesh"]["dp_shard"] == 2, seen
    assert seen["mode"] == "diloco" and seen["every"] == 2 and seen["dp_mode"] == "replica", seen
    assert seen["outer_steps"] == 2, seen  # 4 inner steps, a sync every 2
    assert seen["picked"] == "dp_replicate=2,dp_shard=2/fp32/diloco:every=2", seen
    assert seen["precision"] == "fp32", seen
    assert "replicate diloco:" in log, log[-4000:]  # why, against the sync twin
