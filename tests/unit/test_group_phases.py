"""A replica group's metrics say where a boundary's time goes (``replica_groups/meet_s``,
``wait_s``, ``exchange_s``, ``agree_s``: means per boundary since the last report), so a
user whose steps are slower as groups than alone can see which part costs it.

One group on a local quorum in this process (no Ray, no process group).
"""

from __future__ import annotations

import torch

from harness.local_coordinator import LocalCoordinator
from ray_mesh.replicas import ReplicaGroup
from ray_mesh.replicas.group import PHASES
from ray_mesh.replicas.link_store import serve_store
from ray_mesh.replicas.quorum import Quorum


def test_each_boundary_phase_is_reported_per_boundary_and_then_reset():
    store, address = serve_store("127.0.0.1")
    quorum = Quorum(segment_samples=2, total_steps=3, expected_groups=1)
    model = torch.nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rg = ReplicaGroup(model, optim, client=LocalCoordinator(quorum, address), group_id=0,
                      total_steps=3, segment_samples=2, layout="dp_shard=1")
    try:
        rg.commit()  # joins
        while rg.running:
            model(torch.ones(len(rg.sample_ids()), 2)).sum().backward()
            assert rg.commit()
        got = rg.metrics()
        phases = {k: got[f"replica_groups/{k}"] for k in PHASES}
        assert all(v >= 0 for v in phases.values()), phases
        # a group alone never waits for others; its boundaries do take some time
        assert phases["wait_s"] < 0.5 and sum(phases.values()) > 0, phases
        again = rg.metrics()  # nothing since: zeros, not the old means again
        assert all(again[f"replica_groups/{k}"] == 0 for k in PHASES), again
    finally:
        rg.finish()
        del store
