"""Multi-node logic without a cluster: interface choice, env, planner, pre-flight analysis.

The pre-flight runs for real here too (real sockets on this machine's lo and eth0), with a
thread pool standing in for the per-node Ray actors.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket

import pytest
from ports import free_port

from ray_mesh.core.layout import LayoutError, family_mesh
from ray_mesh.core.topology import TopologyError, WorkerReport
from ray_mesh.network import interfaces as network
from ray_mesh.network.interfaces import (
    NCCL_VPN_DEFAULTS,
    Choice,
    NetworkError,
    choose_all,
    choose_interface,
    collective_env,
    host_port,
    rendezvous_url,
    split_host_port,
)
from ray_mesh.network.probe import Target, probe_peers
from ray_mesh.network.report import NodeTarget, version_problems
from ray_mesh.planning.cluster import NodeInfo, nodes_from_ray, plan_cluster
from ray_mesh.raytrain.preflight import Outcome, run_preflight

TABLE = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["192.168.1.5"],
    "docker0": ["172.17.0.1"],
    "tailscale0": ["100.101.102.103", "fd7a:115c:a1e0::1"],
}


# ----------------------------------------------------------------------------- interfaces
def test_choice_follows_ray_ip_then_tailscale_range_then_name():
    assert choose_interface("192.168.1.5", "auto", TABLE).interface == "eth0"
    c = choose_interface("10.9.9.9", "auto", TABLE)  # Ray IP on no interface here
    assert (c.interface, c.address, c.reason) == ("tailscale0", "100.101.102.103",
                                                  "address in Tailscale's range")
    c6 = choose_interface("fd7a:115c:a1e0::1", "auto", TABLE)
    assert (c6.interface, c6.family) == ("tailscale0", "AF_INET6")
    named = choose_interface("fd7a:115c:a1e0::9", "tailscale0", TABLE)
    assert named.address == "fd7a:115c:a1e0::1"  # same family as the node IP


def test_missing_interface_and_no_tailnet_errors_list_what_exists():
    with pytest.raises(NetworkError) as err:
        choose_interface("100.101.102.103", "wlan0", TABLE)
    for name in TABLE:
        assert name in str(err.value)
    no_ts = {k: v for k, v in TABLE.items() if k != "tailscale0"}
    with pytest.raises(NetworkError, match="--node-ip-address"):
        choose_interface("10.9.9.9", "auto", no_ts)


def test_choose_all_names_every_failing_node_once():
    reports = [
        WorkerReport(0, "a", "100.64.0.1", "h0", 0, interfaces={"tailscale0": ["100.64.0.1"]}),
        WorkerReport(1, "b", "100.64.0.2", "h1", 0, interfaces={"eth0": ["10.0.0.2"]}),
        WorkerReport(2, "b", "100.64.0.2", "h1", 1, interfaces={"eth0": ["10.0.0.2"]}),
        WorkerReport(3, "c", "100.64.0.3", "h2", 0, interfaces={"eth0": ["10.0.0.3"]}),
    ]
    with pytest.raises(NetworkError) as err:
        choose_all(reports, "tailscale0")
    msg = str(err.value)
    assert "2 of 3 node(s)" in msg and msg.count("100.64.0.2 (h1)") == 1
    assert "100.64.0.3 (h2)" in msg and "100.64.0.1 (h0)" not in msg
    assert [c.interface for c in choose_all(reports[:1], "auto")] == ["tailscale0"]


def test_a_node_registered_under_its_lan_address_beside_tailnet_nodes_is_refused():
    """Ray registers the LAN address when ``ray start --address`` named the head by a LAN
    name; the other nodes, reached only on the tailnet, could not reach it."""
    both = {"eth0": ["192.168.1.7"], "tailscale0": ["100.64.0.2"]}
    reports = [
        WorkerReport(0, "a", "100.64.0.1", "h0", 0,
                     interfaces={"eth0": ["10.0.0.1"], "tailscale0": ["100.64.0.1"]}),
        WorkerReport(1, "b", "192.168.1.7", "h1", 0, interfaces=both),
        WorkerReport(2, "b", "192.168.1.7", "h1", 1, interfaces=both),
    ]
    with pytest.raises(NetworkError) as err:
        choose_all(reports, "auto")
    msg = str(err.value)
    assert msg.count("node 192.168.1.7 (h1) registered with Ray under 192.168.1.7 (eth0)") == 1
    assert "tailnet address 100.64.0.2 on tailscale0" in msg and "(100.64.0.1)" in msg
    assert "--node-ip-address=$(tailscale ip -4)" in msg and "interface='tailscale0'" in msg
    # named by the user: the tailnet for every node, nothing refused
    assert {c.address for c in choose_all(reports, "tailscale0")} == {"100.64.0.1",
                                                                      "100.64.0.2"}
    # one network: all on the LAN (Tailscale installed or not), or a node without a tailnet
    lan = [WorkerReport(0, "a", "192.168.1.6", "h0", 0,
                        interfaces={"eth0": ["192.168.1.6"], "tailscale0": ["100.64.0.1"]}),
           reports[1]]
    assert [c.interface for c in choose_all(lan, "auto")] == ["eth0", "eth0"]
    plain = [reports[0], WorkerReport(1, "c", "10.0.0.3", "h2", 0,
                                      interfaces={"eth0": ["10.0.0.3"]})]
    assert [c.interface for c in choose_all(plain, "auto")] == ["tailscale0", "eth0"]


def test_ipv6_brackets_where_a_url_needs_them():
    assert host_port("fd7a:115c:a1e0::1", 29500) == "[fd7a:115c:a1e0::1]:29500"
    assert rendezvous_url("100.64.0.1", 29500) == "tcp://100.64.0.1:29500"
    assert rendezvous_url("fd7a:115c:a1e0::1", 1) == "tcp://[fd7a:115c:a1e0::1]:1"
    assert split_host_port("[fd7a::1]:6379") == ("fd7a::1", 6379)
    assert split_host_port("fd7a::1", 6379) == ("fd7a::1", 6379)
    assert split_host_port("head.tail.ts.net", 6379) == ("head.tail.ts.net", 6379)
    with pytest.raises(ValueError, match="no valid port"):
        split_host_port("100.64.0.1:http")


def test_env_vpn_defaults_only_on_a_vpn_and_user_values_win(monkeypatch):
    vpn = Choice("tailscale0", "100.64.0.1", "AF_INET", "x")
    lan = Choice("ib0", "10.0.0.1", "AF_INET", "x")
    env = collective_env(vpn)
    assert env["NCCL_SOCKET_IFNAME"] == "=tailscale0" and env["GLOO_SOCKET_IFNAME"] == "tailscale0"
    assert all(env[k] == v for k, v in NCCL_VPN_DEFAULTS.items())
    assert "NCCL_IB_DISABLE" not in collective_env(lan)  # never disable IB on a LAN
    assert collective_env(lan, True)["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_NET" not in collective_env(vpn, False)

    # apply_env writes os.environ: give it a copy, and check the real one is untouched after.
    real, before = os.environ, dict(os.environ)
    with monkeypatch.context() as mp:
        mp.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in env})
        os.environ["NCCL_SOCKET_NTHREADS"] = "8"
        applied = network.apply_env(env)
        assert applied["NCCL_SOCKET_NTHREADS"] == "8" == os.environ["NCCL_SOCKET_NTHREADS"]
        assert os.environ["NCCL_NET"] == "Socket"
        assert os.environ is not real and os.environ["GLOO_SOCKET_IFNAME"] == "tailscale0"
    assert os.environ is real and dict(os.environ) == before  # nothing leaked
    kept = network.user_kept(env, applied)
    assert kept == {"NCCL_SOCKET_NTHREADS": "8"}
    line = network.rank_env_line(3, 1, vpn, applied, kept)
    assert "rank 3 (node 1): interface tailscale0" in line
    assert "NCCL_SOCKET_NTHREADS=8 (set by the user)" in line
    assert "NCCL_NET=Socket " in line or line.endswith("NCCL_NET=Socket")


# ----------------------------------------------------------------------------- planner
def _node(ip, gpus=0, slot=0, accel="", alive=True, head=False):
    return NodeInfo(node_id=f"id-{ip}", ip=ip, gpus=gpus, cpus=8,
                    resources={"slot": slot} if slot else {}, accelerator=accel,
                    alive=alive, is_head=head)


def test_plan_homogeneous_hsdp_table():
    nodes = [_node("100.64.0.1", 4, head=True), _node("100.64.0.2", 4)]
    plan = plan_cluster(nodes, "hsdp")
    s = plan.mesh.spec
    assert (s.dp_replicate, s.dp_shard, plan.num_workers) == (2, 4, 8)
    assert [plan.mesh.node_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    text = plan.format()
    assert "ScalingConfig(num_workers=8, use_gpu=True)" in text and "left out" not in text


def test_plan_heterogeneous_uses_the_set_with_most_workers_and_says_why():
    nodes = [_node("100.64.0.1", 4, accel="A100", head=True), _node("100.64.0.2", 4,
             accel="A100"), _node("100.64.0.7", 4, accel="A100"),
             _node("100.64.0.3", 1, accel="A100"),
             _node("100.64.0.4", 8, accel="A10G"), _node("100.64.0.5", 4, alive=False)]
    plan = plan_cluster(nodes, "hsdp")
    assert [n.ip for n in plan.used] == ["100.64.0.1", "100.64.0.2", "100.64.0.7"]
    assert plan.per_node == 4
    why = dict((n.ip, w) for n, w in plan.left_out)
    assert "fewer than the 4 per node" in why["100.64.0.3"]
    assert "accelerator (A10G) differs" in why["100.64.0.4"]
    assert "not alive" in why["100.64.0.5"]
    # 8+8 beats 4+4+4: a bigger node group wins, using only as many per node as all have.
    more = [*nodes, _node("100.64.0.6", 8, accel="A10G")]
    plan2 = plan_cluster(more, "hsdp")
    assert {n.ip for n in plan2.used} == {"100.64.0.4", "100.64.0.6"} and plan2.per_node == 8
    # 4+4+8 (using 4 of the 8) beats 8 alone on a single accelerator type; on a tie the
    # fuller nodes win (8 on one node beats 4+4 across two).
    mixed = [_node("100.64.0.1", 4, head=True), _node("100.64.0.2", 4), _node("100.64.0.3", 8)]
    plan3 = plan_cluster(mixed, "tp_hsdp")
    assert plan3.num_workers == 12 and plan3.mesh.spec.tp == 4
    assert any("uses 4 of them" in n for n in plan3.notes)
    tie = plan_cluster([_node("100.64.0.1", 4, head=True), _node("100.64.0.3", 8)], "hsdp")
    assert [n.ip for n in tie.used] == ["100.64.0.3"] and tie.per_node == 8


def test_families_and_what_cannot_fit():
    assert family_mesh("tp_pp", 2, 4).shape == (2, 1, 1, 1, 4)
    assert family_mesh("pp_tp_hsdp", 4, 4).shape == (2, 2, 2, 1, 2)
    assert family_mesh("tp_hsdp", 3, 2).shape == (1, 3, 1, 1, 2)
    assert family_mesh("hsdp", 2, 4, tp=2).shape == (1, 2, 2, 1, 2)  # hsdp with tp inside
    assert str(plan_cluster([_node("100.64.0.1", 4), _node("100.64.0.2", 4)], "tp_pp")
               .layout) == "pp=2,tp=4/fp32/sync"
    with pytest.raises(TopologyError, match="No pp_tp_hsdp layout fits"):
        plan_cluster([_node("100.64.0.1", 3), _node("100.64.0.2", 3)], "pp_tp_hsdp", tp=2)
    with pytest.raises(LayoutError, match="'tp-pp' is now spelled 'tp_pp'"):
        plan_cluster([_node("100.64.0.1", 4)], "tp-pp")
    with pytest.raises(TopologyError, match="No live node has 'GPU'"):
        plan_cluster([_node("100.64.0.1", 0, slot=2)], "hsdp")
    assert plan_cluster([_node("100.64.0.1", 0, slot=2)], "hsdp", resource="slot").per_node == 2


def test_nodes_from_ray_records():
    raw = [{"NodeID": "b", "Alive": True, "NodeManagerAddress": "100.64.0.2",
            "NodeManagerHostname": "w", "Resources": {"CPU": 4.0, "GPU": 2.0, "slot": 2.0,
            "node:100.64.0.2": 1.0, "accelerator_type:A100": 1.0, "memory": 1e9}},
           {"NodeID": "a", "Alive": True, "NodeManagerAddress": "100.64.0.9",
            "Resources": {"CPU": 2.0, "node:__internal_head__": 1.0}}]
    nodes = nodes_from_ray(raw)
    assert [n.node_id for n in nodes] == ["a", "b"]  # head first
    assert nodes[1].resources == {"slot": 2.0} and nodes[1].accelerator == "A100"
    assert nodes[1].gpus == 2 and nodes[0].is_head


# ----------------------------------------------------------------------------- pre-flight
class ThreadExecutor:
    """Runs each "node's" steps in a thread of this process (real sockets)."""

    def __init__(self) -> None:
        self.pool = cf.ThreadPoolExecutor(16)

    def submit(self, node, fn, *args):
        return self.pool.submit(fn, *args)

    def wait(self, handles, timeout_s):
        done, _ = cf.wait(handles, timeout=max(timeout_s, 0))
        return [Outcome("timeout") if h not in done else
                Outcome("error", repr(h.exception())) if h.exception() else
                Outcome("ok", h.result()) for h in handles]


class SilentNodeExecutor(ThreadExecutor):
    """Node 1 never answers (its link is down)."""

    def submit(self, node, fn, *args):
        if node == 1:
            return cf.Future()
        return super().submit(node, fn, *args)



def test_preflight_passes_on_reachable_addresses_and_frees_the_rendezvous_port():
    port = free_port()
    nodes = [NodeTarget("127.0.0.1", "lo"), NodeTarget("127.0.0.1", "auto")]
    report = run_preflight(ThreadExecutor(), nodes, rendezvous_port=port, timeout_s=10)
    assert report.ok, report.format()
    assert report.matrix[(0, 1)].ok and report.matrix[(1, 0)].ok
    assert report.rendezvous[0].ok and report.rendezvous[1].ok
    # torch's TCPStore binds the port right after: it must be free again.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_preflight_names_a_silent_node_within_the_bound():
    nodes = [NodeTarget("127.0.0.1", "lo"), NodeTarget("127.0.0.2", "lo", "gone")]
    # Node 1's future never completes, so returning at all means the 3 s deadline ended
    # the wait (the message names it); pytest-timeout fails a wait without one.
    report = run_preflight(SilentNodeExecutor(), nodes, rendezvous_port=free_port(),
                           timeout_s=3)
    assert not report.ok
    assert "node 1 (127.0.0.2, gone) did not answer within the 3 s" in report.error_message()


def test_preflight_missing_interface_on_one_node_still_checks_the_rest():
    nodes = [NodeTarget("127.0.0.1", "lo"), NodeTarget("127.0.0.1", "wlan9"),
             NodeTarget("127.0.0.1", "lo")]
    report = run_preflight(ThreadExecutor(), nodes, rendezvous_port=free_port(),
                           timeout_s=10)
    msg = report.error_message()
    assert "node 1 (127.0.0.1" in msg and "'wlan9' does not exist" in msg
    assert report.matrix[(0, 2)].ok  # the rest was still checked


def test_connect_refused_is_reported_as_a_blocked_port():
    res = probe_peers("127.0.0.1", [Target(1, "127.0.0.1", free_port())], 2.0, "n" * 32)
    assert not res[1].ok and "refused" in res[1].error


def test_version_mismatch_names_nodes_and_fix():
    versions = [{"torch": "2.13.0", "ray": "2.60.0", "python": "3.11.7", "nccl": "2.21.5"},
                {"torch": "2.5.1", "ray": "2.60.0", "python": "3.11.7", "nccl": "2.21.5"},
                None]  # a node that did not answer is left out of the comparison
    lines = version_problems(versions, lambda i: f"node {i}")
    assert len(lines) == 1
    assert "torch versions differ" in lines[0] and "2.5.1 on node 1" in lines[0]
    assert "Install the same torch" in lines[0]


def test_address_that_does_not_answer_fails_in_seconds():
    from ray_mesh.cli.job import JobError
    from ray_mesh.cli.runner import check_reachable

    # A port that listens but never accepts: the kernel completes the TCP handshake, the
    # gRPC call then waits for an HTTP/2 answer that never comes. Only the deadline ends it
    # (the message says so); pytest-timeout turns a missing deadline into a failure.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        with pytest.raises(JobError, match=r"Cannot reach the Ray cluster.*gave no answer "
                                           r"within 2 s"):
            check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    # A port that is bound but does not listen refuses at once (a different message).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(JobError, match="gave UNAVAILABLE"):
            check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(JobError, match=r"\[::1\]:1 gave UNAVAILABLE"):
        check_reachable("[::1]:1", timeout_s=2)
    with pytest.raises(JobError, match="not an address"):
        check_reachable("100.64.0.1:notaport")
