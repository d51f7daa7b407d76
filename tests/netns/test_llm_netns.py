"""The llm job on the virtual cluster: 2 namespace nodes x 2 workers, real Ray, Ray Data.

``ray-mesh run`` from a driver in the head namespace, as a user runs it on a tailnet:
dp_shard 2 x tp 2 (tp peers inside a node, dp across the nodes), the tiny preset for 10
steps, the training rows streamed by Ray Data read tasks on both nodes. Checked: it trains
(finite, falling loss), the tp peers got the same batch at every step (the example's guard),
and the sharded checkpoint of the last step is registered in the shared storage.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from llm_job import REPO, check_run, write_job

from harness.netns_cluster import NetnsCluster, netns_unavailable_reason

pytestmark = [pytest.mark.ray, pytest.mark.netns]

STEPS, REPORT = 10, 5


@pytest.mark.slow  # ~5 min: the cluster plus the LM job; the Ray tp=2 run is the default tier
@pytest.mark.timeout(600)
def test_llm_job_trains_and_checkpoints_across_two_nodes(tmp_path):
    if reason := netns_unavailable_reason():
        pytest.skip(f"virtual cluster unavailable: {reason}")
    storage = tmp_path / "results"
    # Half a CPU per worker leaves each 2-CPU node one for Ray Data's read and pack tasks.
    job = write_job(tmp_path / "llm.yaml", name="llm_netns", mesh="{dp_shard: 2, tp: 2}",
                    steps=STEPS, report=REPORT, storage=storage,
                    resources="{CPU: 0.5, slot: 1}")
    with NetnsCluster([{"slot": 2}, {"slot": 2}]) as cluster:
        try:
            proc = cluster.run_in(0, [sys.executable, "-m", "ray_mesh.cli.main", "run",
                                      str(job)], timeout=480,
                                  env={"RAY_ADDRESS": cluster.address, "PYTHONPATH": str(REPO),
                                       "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"ray-mesh run ran past 480 s: {exc.stdout!s:.3000}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "(dp 2 x tp 2)" in out, out[-3000:]
    check_run(out, name="llm_netns", steps=STEPS, report=REPORT, storage=storage)
