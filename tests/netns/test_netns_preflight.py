"""The pre-flight across real network namespaces without Ray: IPv6 and a cut link.

Three namespace nodes with IPv4 and IPv6 tailnet addresses; one Ray-free agent process
per node runs the pre-flight's worker-side steps (the same functions the Ray worker group
runs), so this checks the network logic in seconds.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from harness.netns import NetnsCluster, netns_unavailable_reason
from ray_mesh.network.interfaces import collective_env, host_port
from ray_mesh.network.probe import node_versions
from ray_mesh.network.report import NodeTarget
from ray_mesh.raytrain.preflight import Outcome, run_preflight

pytestmark = pytest.mark.netns
_REASON = netns_unavailable_reason()


class AgentExecutor:
    """run_preflight's executor over one NamespaceAgent per node."""

    def __init__(self, agents) -> None:
        self.agents = agents
        self.pool = cf.ThreadPoolExecutor(16)

    def submit(self, node, fn, *args):
        return self.pool.submit(self.agents[node].call, fn, *args)

    def wait(self, handles, timeout_s):
        done, _ = cf.wait(handles, timeout=max(timeout_s, 0))
        return [Outcome("timeout") if h not in done else
                Outcome("error", str(h.exception())) if h.exception() else
                Outcome("ok", h.result()) for h in handles]


@pytest.fixture(scope="module")
def net():
    if _REASON:
        pytest.skip(f"network namespaces unavailable: {_REASON}")
    with NetnsCluster([{}, {}, {}], start_ray=False, ipv6=True) as cluster:
        agents = [cluster.agent(i) for i in range(3)]
        try:
            for a in agents:  # imports (torch among them) before any timing
                a.call(node_versions)
            yield cluster, AgentExecutor(agents)
        finally:
            for a in agents:
                a.close()


def test_ipv6_tailnet_matrix_passes(net):
    cluster, executor = net
    nodes = [NodeTarget(n.ip6, "auto") for n in cluster.nodes]
    report = run_preflight(executor, nodes, rendezvous_port=29517, timeout_s=10)
    assert report.ok, report.format()
    for i, n in enumerate(cluster.nodes):
        c = report.choice(i)
        assert (c.interface, c.address, c.family) == ("tailscale0", n.ip6, "AF_INET6")
        assert all(report.matrix[(i, j)].ok for j in range(3) if j != i)
        assert report.rendezvous[i].ok
    env = collective_env(report.choice(0))
    assert env["NCCL_SOCKET_FAMILY"] == "AF_INET6" and env["NCCL_SOCKET_IFNAME"] == "=tailscale0"


def test_cut_link_fails_within_bound_naming_the_node_then_recovers(net):
    cluster, executor = net
    nodes = [NodeTarget(n.ip6, "auto") for n in cluster.nodes]
    cut = cluster.nodes[2]
    cluster.cut_link(2)
    try:
        start = time.monotonic()
        report = run_preflight(executor, nodes, rendezvous_port=29518, timeout_s=8)
        elapsed = time.monotonic() - start
    finally:
        cluster.restore_link(2)
    assert not report.ok
    assert elapsed <= 8 + 1.5, elapsed
    msg = report.error_message()
    # Both directions of both pairs with node 2 fail, and node 2 cannot reach rank 0's port;
    # the pair 0 <-> 1 still works. IPv6 peers are written [addr]:port.
    host = f", {report.facts[2].hostname})"  # labels carry the hostname
    assert f"to node 2 ({cut.ip6}{host} at [{cut.ip6}]:" in msg
    assert f"node 2 ({cut.ip6}{host} cannot open TCP from tailscale0 ({cut.ip6})" in msg
    assert f"node 2 ({cut.ip6}{host} cannot reach rank 0's rendezvous port " \
           f"{host_port(cluster.nodes[0].ip6, 29518)}" in msg
    assert report.matrix[(0, 1)].ok and report.matrix[(1, 0)].ok
    assert not report.matrix[(0, 2)].ok and not report.matrix[(2, 1)].ok
    assert len(report.problems) == 5  # 4 matrix cells + node 2's rendezvous check
    # With the link back, the same check passes: the failure was the cut.
    again = run_preflight(executor, nodes, rendezvous_port=29518, timeout_s=8)
    assert again.ok, again.format()


def test_decoy_interface_fails_for_every_pair(net):
    cluster, executor = net
    nodes = [NodeTarget(n.ip, "eth0") for n in cluster.nodes[:2]]
    report = run_preflight(executor, nodes, timeout_s=8)
    assert not report.ok
    for i, n in enumerate(cluster.nodes[:2]):
        assert report.choice(i).address == n.decoy_ip
    assert not report.matrix[(0, 1)].ok and not report.matrix[(1, 0)].ok
