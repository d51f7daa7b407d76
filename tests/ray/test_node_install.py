"""A node whose workers cannot import ray_mesh is refused in seconds, by name.

Seen: ``ray-mesh run --address`` on a cluster whose nodes lack ray_mesh printed the same
setup-hook traceback every ~5 s for a minute, then an ``ActorDiedError`` traceback. Here a
driver joins the session's Ray with a job environment whose workers find a broken
``ray_mesh`` first on their path (a package that fails to import, as a missing or broken
install does), and the job's setup hook ``ray-mesh run`` gives every job. The warm-up that
runs before every ``fit()`` (``driver.warm_controller_actors``) must stop it with one
``ClusterError`` naming the node and the fix.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.ray
COORDINATOR = "AutoscalingCoordinator"  # Ray 2.60's name and namespace for it

DRIVER = """
import sys, ray
sys.path.insert(0, {root!r})
ray.init(address={address!r}, log_to_driver=False, runtime_env={{
    "worker_process_setup_hook": "ray_mesh.raytrain.driver.cluster_worker_setup",
    "env_vars": {{"PYTHONPATH": {shadow!r}}}}})
from ray_mesh.errors import ClusterError
from ray_mesh.raytrain.driver import warm_controller_actors
try:
    warm_controller_actors()
except ClusterError as exc:
    print("REFUSED", exc)
else:
    print("NOT REFUSED")
"""


@pytest.mark.timeout(180)
def test_a_node_that_cannot_import_ray_mesh_is_named_within_seconds(ray_local, tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "ray_mesh").mkdir(parents=True)
    (shadow / "ray_mesh" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'ray_mesh'\")\n")
    # Ray's autoscaling coordinator is one detached, named actor per cluster, made by the
    # first run that asks (ray_mesh's warm-up). Gone here, so that this refused run would
    # be the one to make it: in the job's environment, where ray_mesh does not import, it
    # would never start, and every later run would wait on it (~100 s each).
    with contextlib.suppress(ValueError):
        ray_local.kill(ray_local.get_actor(COORDINATOR, namespace=COORDINATOR))
    context = ray_local.get_runtime_context()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", DRIVER.format(
        root=str(ROOT), address=context.gcs_address, shadow=str(shadow))],
        capture_output=True, text=True, timeout=150, env=env)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    refused = [x for x in proc.stdout.splitlines() if x.startswith("REFUSED ")]
    assert refused, out[-3000:]
    print(refused[0], f"({took:.1f} s)")
    node_ip = ray_local.util.get_node_ip_address()
    assert f"cannot import ray_mesh on node(s) {node_ip} (" in refused[0], refused[0]
    assert "Install ray_mesh in the Python environment `ray start` runs" in refused[0]
    assert took < 60, (took, out[-3000:])  # the warm-up's own bound is 60 s
    with pytest.raises(ValueError):  # the refused run left no coordinator behind
        ray_local.get_actor(COORDINATOR, namespace=COORDINATOR)


def test_the_probe_brings_back_each_nodes_interfaces_for_the_drivers_check(ray_local):
    """The same probe answers with the node's interfaces: with ``interface='auto'`` the
    driver makes the choice the workers will make (the LAN-registered node among tailnet
    nodes is refused this way on the virtual tailnet, tests/netns/test_walkthrough.py); a
    named interface is left to the workers (a node the run does not use need not have
    it)."""
    from ray_mesh.errors import NetworkError
    from ray_mesh.raytrain.node_install import NodeImportProbe

    probe = NodeImportProbe()
    probe.check(timeout_s=60)
    node_ip = ray_local.util.get_node_ip_address()
    assert [r.node_ip for r in probe.answers] == [node_ip], probe.answers
    assert any(node_ip in addrs for addrs in probe.answers[0].interfaces.values())
    probe.check_network("auto")  # the interface that carries the node's Ray IP
    probe.check_network("rmesh-none0")  # not this check's to refuse
    probe.answers[0].interfaces.clear()  # a node with no interface at all: refused
    with pytest.raises(NetworkError, match=rf"No usable interface on 1 of 1 node\(s\): node "
                       rf"{re.escape(node_ip)}"):
        probe.check_network("auto")
