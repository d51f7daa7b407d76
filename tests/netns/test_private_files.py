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

from harness.netns import NODE_LOCAL

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
