"""The live cluster through Ray: its nodes, and ``ray-mesh doctor``'s node agents.

The planning over the nodes found here is Ray-free (``ray_mesh.planning.cluster``); this
module is the part that asks Ray (``ray.nodes()``) and starts one tiny actor per node to
run the pre-flight's worker-side steps (``ray_mesh.network.probe``) there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_mesh.errors import LinkError
from ray_mesh.network.links import LinkMatrix, measure_links
from ray_mesh.network.mtu import MtuReport, measure_path_mtu
from ray_mesh.network.probe import node_versions
from ray_mesh.network.report import DEFAULT_TIMEOUT_S, NodeTarget, PreflightReport
from ray_mesh.planning.cluster import NodeInfo, nodes_from_ray
from ray_mesh.raytrain.preflight import RayRefExecutor, run_preflight


def live_nodes() -> list[NodeInfo]:
    """The cluster's nodes (connect with ``ray.init`` first); dead ones marked not alive."""
    return nodes_from_ray(ray.nodes())


@ray.remote(num_cpus=0, max_restarts=0)
class NodeAgent:
    """A tiny actor pinned to one node that runs the pre-flight's worker-side steps."""

    def ready(self) -> dict[str, str]:
        # Import what the pre-flight calls need (torch included, for its version) now,
        # under the start-up bound, not under the pre-flight's.
        return node_versions()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


class NodeAgents:
    """One agent actor per node, started once and reused for several pre-flights.

    Starting a Python worker per node (imports included) can take longer than the network
    check itself on a busy machine, so it has its own bound (``startup_timeout_s``); a node
    whose agent does not start in time stays in the list and shows up in the report as
    "did not answer", like a node whose link is down.
    """

    def __init__(self, nodes: Sequence[NodeInfo], startup_timeout_s: float = 60.0) -> None:
        self.nodes = [n for n in nodes if n.alive]
        self.agents = [NodeAgent.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n.node_id, soft=False)).remote() for n in self.nodes]
        refs = [a.ready.remote() for a in self.agents]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=startup_timeout_s)
        self.started = [r in ready for r in refs]

    def preflight(self, *, interface: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                  rendezvous_port: int | None = None) -> PreflightReport:
        """The pre-flight on every node (head = node 0, as rank 0 usually is)."""
        executor = RayRefExecutor(lambda i, fn, *args: self.agents[i].call.remote(fn, *args))
        return run_preflight(executor, [NodeTarget(n.ip, interface, n.hostname)
                                        for n in self.nodes],
                             rendezvous_port=rendezvous_port, timeout_s=timeout_s)

    def _run_on(self, bound_s: float) -> Callable[..., Any]:
        def run_on(i: int, fn: Callable[..., Any], *args: Any) -> Any:
            return ray.get(self.agents[i].call.remote(fn, *args), timeout=bound_s)

        return run_on

    def links(self, report: PreflightReport, max_s: float = 1.0) -> LinkMatrix | None:
        """Link bandwidth between the nodes (and each to itself) over the interfaces the
        pre-flight chose; None when the pre-flight failed (no pair to trust). A transfer
        that fails (a blackholed path stalls) ends the measurement: the matrix is empty and
        says why in ``error``, next to the path MTU findings that usually explain it."""
        if not report.ok or not self.nodes:
            return None
        addresses = [report.choice(i).address for i in range(len(self.nodes))]
        try:
            return measure_links(addresses, self._run_on(max_s + 20.0), max_s=max_s)
        except (LinkError, ray.exceptions.RayError, TimeoutError) as exc:
            return LinkMatrix([], error=f"{type(exc).__name__}: {exc}")

    def path_mtu(self, report: PreflightReport) -> MtuReport | None:
        """Every ordered pair's path MTU over the chosen interfaces (``ray_mesh.network.
        mtu``); None when the pre-flight failed."""
        if not report.ok or not self.nodes:
            return None
        addresses = [report.choice(i).address for i in range(len(self.nodes))]
        return measure_path_mtu(addresses, self._run_on(60.0))

    def close(self) -> None:
        for a in self.agents:
            ray.kill(a, no_restart=True)

    def __enter__(self) -> NodeAgents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def doctor(
    nodes: Sequence[NodeInfo] | None = None,
    *,
    interface: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    rendezvous_port: int | None = None,
    startup_timeout_s: float = 60.0,
    link_probe_s: float | None = 1.0,
) -> tuple[PreflightReport, LinkMatrix | None, MtuReport | None]:
    """Run the pre-flight on every live node through short-lived node agents, then (when it
    passed and ``link_probe_s`` is not None) measure the path MTU and the bandwidth of the
    links between them (MTU first: a blackholed path would stall the bandwidth transfer).

    A run's rendezvous port is a random free one, which the matrix's random listener
    ports already stand for; pass ``rendezvous_port`` to check a fixed MASTER_PORT too.
    """
    with NodeAgents(nodes if nodes is not None else live_nodes(),
                    startup_timeout_s) as agents:
        report = agents.preflight(interface=interface, timeout_s=timeout_s,
                                  rendezvous_port=rendezvous_port)
        if not link_probe_s:
            return report, None, None
        mtu = agents.path_mtu(report)
        return report, agents.links(report, link_probe_s), mtu
