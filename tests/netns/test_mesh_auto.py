"""``MeshConfig(mesh="auto")`` on the virtual cluster with shaped links (real Ray, 2 x 2).

The backend measures the node link at bring-up, ranks the layouts the train function can
run, and builds the fastest predicted one: HSDP over flat FSDP and DDP at 100 Mbit/s.
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.ray]

DRIVER = textwrap.dedent("""\
    import json, os, sys
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    import ray_mesh
    from ray_mesh.planning.cost import ModelStats, Workload
    from ray_mesh.planning.inputs import PlanInputs

    def train_fn(config):
        import torch.distributed as dist
        mesh = ray_mesh.get_mesh()
        if dist.get_rank() == 0:
            with open(config["out"], "w") as f:
                json.dump(dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)), f)
        ray.train.report({"done": 1})

    ray.init()
    out = sys.argv[1]
    plan = PlanInputs(ModelStats(params=3_000_000, layers=4, hidden=256, heads=4),
                      Workload(tokens=1024, compute_s=2.0))
    TorchTrainer(train_fn, train_loop_config={"out": out},
                 scaling_config=ScalingConfig(num_workers=4,
                                              resources_per_worker={"CPU": 0.5, "slot": 1}),
                 torch_config=ray_mesh.MeshConfig(mesh="auto", plan=plan, measure_links=True),
                 run_config=RunConfig(name="auto", storage_path=os.path.dirname(out))).fit()
""")


def test_mesh_auto_picks_hsdp_at_100_mbit(plain_cluster):
    # The 2 x {slot: 2} cluster of tests/netns/conftest.py (shared with test_diloco_netns.py),
    # every node's link capped at 100 Mbit/s for this test.
    cluster = plain_cluster
    for node in range(2):
        cluster.shape_link(node, 100)
    try:
        out = cluster.root / "results" / "mesh.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        script = cluster.root / "auto_driver.py"
        script.write_text(DRIVER)
        proc = cluster.run_in(0, ["python", str(script), str(out)], timeout=400,
                              env={"RAY_ADDRESS": cluster.address, "PYTHONUNBUFFERED": "1",
                                   # the controller's look at the workers: 2 s by default
                                   "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"})
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-6000:]
        mesh = json.loads(out.read_text())
    finally:
        for node in range(2):
            cluster.unshape_link(node)
    assert mesh["dp_replicate"] == 2 and mesh["dp_shard"] == 2, (mesh, log[-4000:])
    assert "mesh=auto picked dp_replicate=2,dp_shard=2/" in log, log[-4000:]  # hsdp
    assert "node links measured" in log and "slowest link" in log, log[-4000:]
