"""``ray-mesh doctor`` on the virtual tailnet (real WireGuard): path MTU and relayed links.

* An MTU blackhole: node 2's underlay drops frames over 1300 bytes without a word, so the
  tunnel (MTU 1280, ~60 bytes of WireGuard over UDP) carries at most 1232-byte packets to
  and from it. Small connects pass; the doctor's full-size DF probes find it and name each
  direction, the sizes and the fix.
* A relayed link: only the path 1 <-> 2 is shaped to 2 Mbit/s (``tc`` on the underlay), as
  a DERP relay among direct links; the doctor names that pair, and `tailscale ping`.

The mechanisms run Ray-free through namespace agents (as the doctor's node agents do); the
CLI test, last, starts Ray on the same three nodes (the tests before it leave the links as
they found them) and runs ``ray-mesh doctor`` on that cluster over the tunnel.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.netns import REPO, NetnsCluster, netns_unavailable_reason
from ray_mesh.network.links import measure_links
from ray_mesh.network.mtu import measure_path_mtu


def _skip_if_unavailable() -> None:
    if reason := netns_unavailable_reason():
        pytest.skip(f"virtual Tailscale cluster unavailable: {reason}")


@pytest.fixture(scope="module")
def tailnet():
    _skip_if_unavailable()
    with NetnsCluster([{}, {}, {}], start_ray=False) as c:
        agents = [c.agent(i) for i in range(3)]
        try:
            yield c, (lambda i, fn, *args: agents[i].call(fn, *args))
        finally:
            for a in agents:
                a.close()


def test_clean_tunnel_carries_its_full_mtu_everywhere(tailnet):
    cluster, run_on = tailnet
    report = measure_path_mtu([n.ip for n in cluster.nodes], run_on)
    assert len(report.paths) == 6, report.format()
    assert {(p.mtu, p.interface_mtu, p.interface) for p in report.paths} == \
        {(1280, 1280, "tailscale0")}, report.format()
    assert report.problems() == []


def test_mtu_blackhole_is_found_per_direction_with_the_fix(tailnet):
    cluster, run_on = tailnet
    ip = [n.ip for n in cluster.nodes]
    cluster.set_link_mtu(2, 1300)
    try:
        report = measure_path_mtu(ip, run_on)
    finally:
        cluster.set_link_mtu(2, 1500)
    holes = {(p.a, p.b): p.mtu for p in report.blackholes()}
    assert set(holes) == {(ip[0], ip[2]), (ip[1], ip[2]), (ip[2], ip[0]), (ip[2], ip[1])}, \
        report.format()
    # WireGuard's overhead (60 bytes) padded to 16: 1300 on the underlay leaves 1232.
    assert set(holes.values()) == {1232}, report.format()
    text = "\n".join(report.problems())
    assert f"MTU blackhole {ip[0]} -> {ip[2]}: packets over 1232 bytes" in text
    assert "sudo ip link set tailscale0 mtu 1232" in text
    assert f"ping -M do -s 1252 {ip[2]}" in text
    assert ip[1] not in [p.b for p in report.blackholes() if p.a == ip[0]]


def test_one_slow_path_is_named_as_probably_relayed(tailnet):
    cluster, run_on = tailnet
    ip = [n.ip for n in cluster.nodes]
    cluster.shape_pair(1, 2, 2)
    try:
        # 1 s per transfer, as `ray-mesh doctor` measures (the CLI test below finds the
        # same pair with it); at 2 Mbit/s the probe is sending, not starting, all along.
        matrix = measure_links(ip, run_on, max_s=1.0, within_node=False)
    finally:
        cluster.unshape_link(1)
        cluster.unshape_link(2)
    rate = {frozenset((x.a, x.b)): x.mbit_s for x in matrix.links}
    assert rate[frozenset((ip[1], ip[2]))] < 4, matrix.format()  # 2 set, ~1.8 measured
    assert [(x.a, x.b) for x, _ in matrix.relayed()] == [(ip[1], ip[2])], matrix.format()
    hint = matrix.relay_hints()[0]
    assert "probably relayed (Tailscale DERP)" in hint
    assert f"`tailscale ping {ip[2]}`" in hint and "`tailscale status`" in hint


def test_doctor_cli_over_the_tunnel_names_the_relayed_pair_and_measures_mtu(tailnet):
    """Runs last: Ray on the module's tailnet (a cluster built and torn down less)."""
    cluster, _ = tailnet
    cluster.start_ray_node(0)  # head first, then the workers join it, both at once
    with ThreadPoolExecutor(len(cluster.nodes) - 1) as pool:
        list(pool.map(cluster.start_ray_node, range(1, len(cluster.nodes))))
    cluster.wait_for_nodes(len(cluster.nodes))
    ip = [n.ip for n in cluster.nodes]
    cluster.shape_pair(1, 2, 2)
    try:
        proc = cluster.run_in(0, [sys.executable, "-m", "ray_mesh.cli", "doctor", "--address",
                                  cluster.address, "--json"], timeout=240,
                              env={"PYTHONPATH": str(REPO)})
    finally:
        cluster.unshape_link(1)
        cluster.unshape_link(2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert {(p["a"], p["b"]): p["mtu"] for p in out["path_mtu"]} == \
        {(a, b): 1280 for a in ip for b in ip if a != b}, out
    assert len(out["relayed"]) == 1, out
    assert f"link {ip[1]} <-> {ip[2]}" in out["relayed"][0]
    assert f"tailscale ping {ip[2]}" in out["relayed"][0]
