"""The llm job on the virtual cluster: 2 namespace nodes x 2 workers, real Ray, Ray Data.

``ray-mesh run`` from a driver in the head namespace, as a user runs it on a tailnet:
dp_shard 2 x tp 2 (tp peers inside a node, dp across the nodes), the tiny preset for 10
steps, the training rows streamed by Ray Data read tasks on both nodes. Checked: it trains
(finite, falling loss), the tp peers got the same batch at every step (the example's guard),
and the sharded checkpoint of the last step is registered in the run's storage: an S3 bucket
served by a real moto process (``ray-mesh storage serve``) in the head's namespace on its
tailnet address, which the other node reaches through the WireGuard tunnel (the nodes share
no filesystem for it), given in the job file as ``run.storage_path`` and
``run.storage_endpoint``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from llm_job import REPO, check_run, write_job
from moto_s3 import S3Server, new_credentials

from harness.netns import NetnsCluster, netns_unavailable_reason
from ray_mesh.checkpointing import sharded

pytestmark = [pytest.mark.ray, pytest.mark.netns]

STEPS, REPORT = 10, 5
# Lists the objects under an s3:// URI at an endpoint, one path a line.
LIST = """
import sys
import pyarrow.fs
from ray_mesh.core.object_store import filesystem
fs, root = filesystem(sys.argv[1], sys.argv[2])
for i in fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True)):
    print(i.path)
"""


@pytest.mark.slow  # ~5 min: the cluster plus the LM job; the Ray tp=2 run is the default tier
@pytest.mark.timeout(600)
def test_llm_job_trains_and_checkpoints_across_two_nodes(tmp_path):
    if reason := netns_unavailable_reason():
        pytest.skip(f"virtual cluster unavailable: {reason}")
    # Every machine has the bucket server's key in its environment before Ray starts (the
    # server answers signed requests only).
    creds = new_credentials()
    with NetnsCluster([{"slot": 2}, {"slot": 2}], env=creds) as cluster:
        env = {**creds, "RAY_ADDRESS": cluster.address, "PYTHONPATH": str(REPO),
               "PYTHONUNBUFFERED": "1"}
        s3 = S3Server(bucket="llm-netns", host=cluster.head.ip,
                      prefix=cluster.head.exec_prefix(),
                      env={**cluster.node_env(cluster.head), **env}, credentials=creds)
        # Half a CPU per worker leaves each 2-CPU node one for Ray Data's read and pack tasks.
        job = write_job(tmp_path / "llm.yaml", name="llm_netns", mesh="{dp_shard: 2, tp: 2}",
                        steps=STEPS, report=REPORT, storage=s3.uri("runs"),
                        endpoint=s3.endpoint, resources="{CPU: 0.5, slot: 1}")
        try:
            proc = cluster.run_in(0, [sys.executable, "-m", "ray_mesh.cli.main", "run",
                                      str(job)], timeout=480, env=env)
            listing = cluster.run_in(0, [sys.executable, "-c", LIST, s3.uri("runs/llm_netns"),
                                         s3.endpoint], timeout=60, env=env)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"ray-mesh run ran past 480 s: {exc.stdout!s:.3000}")
        finally:
            s3.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "(dp 2 x tp 2)" in out, out[-3000:]
    check_run(out, name="llm_netns", steps=STEPS, report=REPORT, storage=None)
    # the last step's checkpoint is in the bucket, every rank's shards merged, with its
    # manifest (the bucket is listed from the head: the endpoint is on the tailnet)
    objects = listing.stdout.split()
    assert listing.returncode == 0, listing.stderr[-3000:]
    last = [p for p in objects if f"/checkpoint_{STEPS:08d}_" in p]
    names = {p.rsplit("/", 1)[-1] for p in last}
    assert {sharded.MARKER, sharded.MANIFEST} <= names, objects
    assert len([p for p in last if p.endswith(".distcp")]) == 4, objects
