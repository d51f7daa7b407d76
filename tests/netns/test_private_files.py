"""No shared filesystem between the virtual nodes, as between real machines.

Each node of the virtual cluster has its own ``/tmp/ray-mesh-node`` (its disk, ``TMPDIR``
and Ray's temp dir), ``~/ray_results`` and ``/dev/shm`` (``harness.netns.namespaces``). A
file one node writes there does not exist on another; a checkpoint storage path there (or
Ray Train's default, ``~/ray_results``) is refused before any training, naming the node that
cannot see it. On the old harness every node shared the host's /tmp and home, so both
storage checks passed and a multi-node run "worked" on a path no real cluster shares.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from harness.netns import NODE_LOCAL, REPO

pytestmark = [pytest.mark.ray, pytest.mark.netns]


def test_a_file_on_one_node_is_absent_on_the_other(plain_cluster):
    cluster = plain_cluster
    mark = NODE_LOCAL / "tmp" / "written_on_node_1"
    assert cluster.run_in(1, ["sh", "-c", f"echo one > {mark}"]).returncode == 0
    assert cluster.run_in(1, ["cat", str(mark)]).stdout == "one\n"
    assert cluster.run_in(0, ["cat", str(mark)]).returncode != 0  # not on node 0
    assert not mark.exists()  # nor on the host
    for i in (0, 1):  # scratch (tempfile) lands on the node's own disk
        tmp = cluster.run_in(i, [sys.executable, "-c",
                                 "import tempfile; print(tempfile.gettempdir())"])
        assert tmp.stdout.strip() == str(NODE_LOCAL / "tmp"), tmp


_CHECK = textwrap.dedent("""\
    import json, ray
    from ray_mesh.checkpointing import StorageError, check_storage
    ray.init(address="auto", log_to_driver=False)
    out = {}
    for name, path in (("node_disk", "/tmp/ray-mesh-node/ckpt"), ("default", None)):
        try:
            out[name] = {"ok": check_storage(path, timeout_s=60)}
        except StorageError as exc:
            out[name] = {"error": str(exc)}
    print("RESULT " + json.dumps(out))
""")


def test_storage_only_the_head_sees_is_refused_naming_the_blind_node(plain_cluster):
    cluster = plain_cluster
    proc = cluster.run_python(_CHECK, timeout=180)
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    blind = f"not visible on nodes ['{cluster.nodes[1].ip}']"
    for name in ("node_disk", "default"):  # default: Ray Train's ~/ray_results
        assert "error" in out[name], out
        assert "is local to each node" in out[name]["error"] and blind in out[name]["error"]
        assert "s3://" in out[name]["error"]  # the fix: shared storage or a cloud URI


_FIT = textwrap.dedent("""\
    import json, sys, ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    import ray_mesh
    from ray_mesh.cli.job import load_function
    ray.init(address="auto", log_to_driver=False)
    log = sys.argv[1]
    trainer = TorchTrainer(
        load_function(sys.argv[2] + ":train_loop"),
        train_loop_config={"steps": 6, "every": 4, "log": log, "final": log + ".pt",
                           "upload": False},
        # One worker per node (each has slot: 2): a rank on each side of the node-local
        # path is all the check needs, and half the workers to start.
        scaling_config=ScalingConfig(num_workers=2,
                                     resources_per_worker={"CPU": 0.5, "slot": 2}),
        torch_config=ray_mesh.MeshConfig(mesh=ray_mesh.MeshSpec.hsdp()),
        run_config=RunConfig(name="nodelocal", storage_path="/tmp/ray-mesh-node/results"))
    try:
        trainer.fit()
        print("RESULT " + json.dumps({"error": None}))
    except Exception as exc:
        print("RESULT " + json.dumps({"error": str(exc)}))
""")


def test_python_api_run_on_node_local_storage_stops_before_the_first_step(plain_cluster,
                                                                            tmp_path):
    """Through the Python API (no ``check_storage``) the Checkpointer checks the storage
    before the first step; it used to fail only at the first save, ``every`` steps in."""
    cluster = plain_cluster
    tmp_path.chmod(0o777)
    log = tmp_path / "nodelocal.log"  # shared (pytest's tmp_path): the test reads it
    script = tmp_path / "fit.py"
    script.write_text(_FIT)
    proc = cluster.run_in(0, [sys.executable, str(script), str(log),
                              str(REPO / "harness" / "ckpt_train.py")], timeout=300,
                          env={"RAY_ADDRESS": cluster.address, "PYTHONPATH": str(REPO),
                               # the controller sees the failed start in 0.2 s, not 2 s
                               "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"})
    assert "RESULT " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = json.loads(proc.stdout.split("RESULT ", 1)[1])["error"] or ""
    assert "is local to each node" in error, error[-3000:]
    # The blind node is the one without rank 0 (not always the head: Ray places the ranks).
    assert sum(f"on nodes ['{n.ip}']" in error for n in cluster.nodes) == 1, error[-3000:]
    assert "s3://" in error, error[-3000:]
    assert not log.exists(), log.read_text()  # no rank got past the Checkpointer
