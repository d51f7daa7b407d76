"""DiLoCo on the virtual cluster: 2 nodes x 2 workers, real Ray, replicate dim across nodes.

One fit of ``benchmarks/diloco.py``'s train function (DiLoCo every 4 steps, int8, FSDP
inside each node), unshaped links: it trains (the loss falls), the replicas are bitwise
equal after every sync, and inner steps between syncs send next to nothing across nodes
(each node's ``tailscale0`` tx counters, Ray's idle traffic subtracted), where one sync
HSDP step sends a whole gradient all-reduce.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.netns

MODEL = {"vocab": 64, "dim": 64, "heads": 4, "layers": 2, "ffn": 256, "seq": 32,
         "batch_size": 8, "lr": 0.01, "seed": 0, "mixed_precision": None}


@pytest.mark.timeout(400)
def test_diloco_across_nodes_trains_and_keeps_replicas_equal(plain_cluster, monkeypatch):
    from benchmarks.diloco import MODULES, run_on_cluster

    # The driver inherits it (NetnsCluster.node_env), Ray Train passes it on: the
    # controller looks at the workers every 0.2 s, not 2 s (the run's start and end wait).
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

    args = {"rates": [None], "modes": ["sync", "diloco"], "steps": 12, "val_batches": 2,
            "module": MODULES["toy"][0], "model": MODEL,
            "replicate": {"every": 4, "compress": "int8"}}
    # The 2 x {slot: 2} cluster of tests/netns/conftest.py, shared with test_mesh_auto.py.
    for node in range(2):
        plain_cluster.unshape_link(node)
    raw = run_on_cluster(plain_cluster, args, timeout_s=300)
    sync, dl = raw["phases"]["unshaped/sync"], raw["phases"]["unshaped/diloco"]
    print({k: v for k, v in dl.items() if k != "losses"})
    assert dl["replicas_equal_after_syncs"] == [True, True, True], dl
    assert dl["metrics"]["diloco/outer_step"] == 3 and dl["metrics"]["diloco/inner_step"] == 12
    assert dl["val_loss"] < dl["losses"][0] * 0.9, dl["losses"]
    # one sync step all-reduces the gradient across nodes; an inner step sends ~nothing
    assert sync["cross_node_bytes_per_step"] > 100_000, sync["cross_node_bytes_per_step"]
    assert dl["inner_cross_node_bytes_per_step"] < 0.03 * sync["cross_node_bytes_per_step"], (
        dl["inner_cross_node_bytes_per_step"], sync["cross_node_bytes_per_step"])
    # amortised over H=4 with int8, DiLoCo moves well under sync's bytes per step
    assert dl["cross_node_bytes_per_step"] < 0.3 * sync["cross_node_bytes_per_step"]
