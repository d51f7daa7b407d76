"""Before a run on a cluster: can Ray's workers on every node import ray_mesh?

A node whose Python lacks ray_mesh (installed on the head only, or ``ray start`` run from
another virtualenv) cannot run any of the run's processes. Under ``ray-mesh run --address``
each of them dies in the job's ``worker_process_setup_hook`` (a ray_mesh function) before it
runs anything; Ray restarts the autoscaling coordinator and the Train controller over and
over, prints the same traceback every ~5 s, and the run ends a minute later in an
``ActorDiedError`` traceback (seen, 65 s). Through the Python API the workers fail to
unpickle ``MeshConfig`` instead. One 0-CPU task per node, not retried, finds either in about
a second, beside the controller warm-up (``driver.warm_controller_actors``), and the run
stops with one line that names the node and the fix.

The same probe brings back each node's interfaces, so a node that registered with Ray under
its LAN address among nodes on the tailnet (``network.interfaces.check_one_network``) is
refused here too, before any training worker starts (on the workers it took ~18 s more).
"""

from __future__ import annotations

import socket
import sys
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_mesh.core.topology import WorkerReport
from ray_mesh.errors import ClusterError
from ray_mesh.network.interfaces import choose_all, local_interfaces


@ray.remote(num_cpus=0, max_retries=0)
def _import_ray_mesh() -> dict[str, Any]:
    """Its body is not the test: a worker runs it only after importing this module (Ray
    sends the function by reference), which imports ``ray_mesh`` as every process of the
    run does, and after the job's setup hook, which is ray_mesh's under ``ray-mesh run``.
    It returns what the driver's network check needs of the node."""
    return {"python": sys.executable, "hostname": socket.gethostname(),
            "interfaces": local_interfaces()}


class NodeImportProbe:
    """The probes in flight, one per alive node; :meth:`check` raises on the first bad one."""

    def __init__(self) -> None:
        self.refs: dict[Any, tuple[str, str]] = {}  # probe -> (node address, node id)
        self.answers: list[WorkerReport] = []  # the nodes whose probe came back, as reports
        for node in ray.nodes():
            if node.get("Alive"):
                ref = _import_ray_mesh.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node["NodeID"], soft=False)).remote()
                self.refs[ref] = (node.get("NodeManagerAddress", node["NodeID"][:12]),
                                  node["NodeID"])

    def check(self, timeout_s: float = 0.0, node_id: str | None = None) -> None:
        """Raise :class:`ClusterError` for every probe that failed within ``timeout_s``
        (``node_id``: that node's probe only). A probe still pending at the bound is left
        alone: a busy node starts a worker late, and the run's own bounded start-up names a
        node that never does."""
        deadline = time.monotonic() + timeout_s
        bad: list[str] = []
        while True:
            waiting = [r for r, (_, n) in self.refs.items() if node_id in (None, n)]
            if not waiting:
                break
            left = max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(waiting, num_returns=1, timeout=left)
            if not ready:
                break
            node, nid = self.refs.pop(ready[0])
            try:
                got = ray.get(ready[0])
                self.answers.append(WorkerReport(
                    rank=len(self.answers), node_id=nid, node_ip=node,
                    hostname=got["hostname"], interfaces=got["interfaces"]))
            except ray.exceptions.WorkerCrashedError:
                bad.append(f"{node} (its worker process died before running anything: Ray's "
                           f"message above says why, 'Failed to execute the setup hook' when "
                           f"ray_mesh is missing there)")
            except Exception as exc:  # noqa: BLE001 - the import's own error, named
                cause = getattr(exc, "cause", None) or exc
                bad.append(f"{node} ({type(cause).__name__}: {' '.join(str(cause).split())[:160]})")
        if bad:
            raise ClusterError(
                f"Ray's workers cannot import ray_mesh on node(s) {'; '.join(bad)}. Install "
                f"ray_mesh in the Python environment `ray start` runs on each of them (the "
                f"same version as this machine's: `pip install ray_mesh`, or `pip install -e` "
                f"of the same checkout), then restart Ray there (`ray stop`, then its `ray "
                f"start` line again).")

    def check_network(self, interface: str) -> None:
        """With ``interface='auto'``, the choice the workers will make, made now for each
        node that answered (``network.interfaces.choose_all``): a node with no usable
        interface, or one that registered under its LAN address among nodes on the tailnet
        (a cluster Ray itself cannot move objects across), is refused before any training
        worker starts. A named interface is left to the workers: a node the run does not
        use (a head without GPUs) need not have it. Nodes still pending are left to the
        workers' own check too."""
        if self.answers and interface in ("auto", "", None):
            choose_all(self.answers, interface)
