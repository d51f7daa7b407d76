"""What listens where on a deploy-script node, and the firewall recipe (issue #18 item 5).

A virtual Tailscale cluster (2 namespaces, Ray started by deploy/tailscale/ray-head.sh and
ray-worker.sh, dashboard on) is listed with ``ss -ltnp`` in each namespace:

* what the scripts bind (the dashboard) is on the tailnet address only, and nothing is on
  the decoy ``eth0`` address alone;
* every (component, bound-to) pair seen equals the "What is exposed" table in
  deploy/README.md, so the table cannot go stale silently when Ray changes;
* torch's rendezvous store and gloo, as ray_mesh's bootstrap starts them under Ray Train
  (MASTER_ADDR = the tailnet address, GLOO_SOCKET_IFNAME=tailscale0), are listed the same
  way: the store on the tailnet address only (ray_mesh binds it; torch alone binds all);
* the table's "Token" column for the HTTP endpoints: the three /metrics answer a tailnet
  peer without a token, the dashboard and the agent's HTTP answer 401;
* deploy/tailscale/firewall.sh (nft and iptables) applied inside a namespace refuses a
  client on the decoy network while the tailnet peer still connects; apply is idempotent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from ports import free_port_in  # noqa: E402

from harness.netns import REPO, NetnsCluster, netns_unavailable_reason  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.netns]

_REASON = netns_unavailable_reason()
FIREWALL = REPO / "deploy" / "tailscale" / "firewall.sh"
README = REPO / "deploy" / "README.md"
STORAGE_SERVER = "ray-mesh storage serve"  # a row of the table a user starts by hand
# Fixed ports every head has once it has settled: dashboard, its /metrics, the autoscaler's.
HEAD_PORTS = {8265, 44227, 44217, 6379}


@pytest.fixture(scope="module")
def cluster(dashboard_cluster):
    # tests/netns/conftest.py: a fresh cluster (this module runs before test_multinode.py,
    # which shares it), 2 nodes x slot: 2 with the dashboard, 4 tries per `ray start`.
    return dashboard_cluster


def _component(pid: int) -> str:
    """The README's name for the Ray/torch process ``pid`` (from its command line)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    # Ray's agents and workers rename themselves (setproctitle): "ray::DashboardAgent",
    # "ray::IDLE", "ray::TrainController", ...; every other ray:: process is a core worker.
    rules = [("_torch_rendezvous", "torch"), ("gcs_server", "GCS"),
             ("/raylet/raylet ", "raylet"), ("ray::DashboardAgent", "dashboard agent"),
             ("dashboard/agent.py", "dashboard agent"),
             ("ray::RuntimeEnvAgent", "runtime env agent"),
             ("runtime_env/agent/main.py", "runtime env agent"),
             ("dashboard/dashboard.py", "dashboard"), ("monitor.py", "autoscaler monitor"),
             ("ray.util.client.server", "Ray Client server"), ("ray::", "core worker"),
             ("default_worker.py", "core worker")]
    return next((name for key, name in rules if key in cmd), f"unknown: {cmd[:120]}")


def _scope(addr: str, node_ip: str) -> str:
    addr = addr.strip("[]").removeprefix("::ffff:")
    if addr in ("0.0.0.0", "*", "::"):
        return "all interfaces"
    if addr == node_ip:
        return "tailnet address"
    if addr in ("127.0.0.1", "::1"):
        return "127.0.0.1"
    return f"other ({addr})"


def listeners(cluster: NetnsCluster, index: int) -> list[tuple[str, int, str, str]]:
    """``(component, port, scope, raw address)`` of every TCP listener in node ``index``."""
    out = cluster.run_in(index, ["ss", "-Hltnp"]).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        addr, _, port = parts[3].rpartition(":")
        pid = re.search(r"pid=(\d+)", line)
        comp = _component(int(pid.group(1))) if pid else "no pid"
        found.append((comp, int(port), _scope(addr, cluster.nodes[index].ip), addr))
    return found


def readme_table() -> set[tuple[str, str, str]]:
    """(component, port, bound to) of each row of deploy/README.md's "What is exposed" table.

    The port is the row's fixed port number (8265, 44227, ...) or "any" for a random one.
    """
    text = README.read_text()
    section = text.split("### What is exposed", 1)[1].split("\n#", 1)[0]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and not set(cells[0]) <= {"-", " "} and cells[0] != "Component":
            fixed = re.match(r"(\d{2,5})\b", cells[1])
            for scope in cells[2].split(" + "):
                rows.add((cells[0], fixed.group(1) if fixed else "any", scope.strip()))
    return rows


def _keyed(rows, documented) -> set[tuple[str, str, str]]:
    """Listeners as (component, port, bound to), a port kept only where the table fixes it."""
    fixed = {(c, p) for c, p, _ in documented if p != "any"}
    return {(c, str(p) if (c, str(p)) in fixed else "any", s) for c, p, s, _ in rows}


def _settled(cluster: NetnsCluster, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ports = {p for _, p, _, _ in listeners(cluster, 0)}
        if ports >= HEAD_PORTS:
            return
        time.sleep(1)
    raise AssertionError(f"the head never listened on all of {sorted(HEAD_PORTS)}: "
                         f"{sorted(ports)}")


def test_listeners_match_the_readme_table(cluster):
    _settled(cluster)
    # torch's rows live only during a run (test_torch_rendezvous_and_gloo_listeners), the
    # storage server's only when a user starts it.
    documented = {r for r in readme_table() if r[0] not in ("torch", STORAGE_SERVER)}
    seen: set[tuple[str, str, str]] = set()
    for i in range(len(cluster.nodes)):
        rows = listeners(cluster, i)
        print(f"node {i} ({cluster.nodes[i].ip}):")
        for comp, port, scope, addr in sorted(rows):
            print(f"  {port:>5}  {comp:<20} {scope:<16} {addr}")
        for comp, port, scope, addr in rows:
            assert not comp.startswith(("unknown", "gone", "no pid")), (comp, port, addr)
            assert not scope.startswith("other"), f"{comp} on {addr}:{port}: not documented"
        seen |= _keyed(rows, documented)
        # What the scripts bind: the dashboard (head) on the tailnet address only.
        if i == 0:
            assert {s for c, p, s, _ in rows if p == 8265} == {"tailnet address"}, rows
    # The documented table and the listeners seen are the same set (the head and a worker
    # together have every component the table names).
    assert seen == documented, (f"seen but not in deploy/README.md: {sorted(seen - documented)}"
                                f"; documented but not seen: {sorted(documented - seen)}")


_TORCH = """
import os, sys, time
import torch
import torch.distributed as dist
from ray_mesh.core.bootstrap import init_process_group
# _torch_rendezvous: this marker in the command line names the process "torch" in listeners()
init_process_group("gloo", torch.device("cpu"), int(sys.argv[1]), 2, timeout_s=60)
dist.barrier()
print("READY", flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.2)
dist.barrier()
dist.destroy_process_group()
"""


def test_torch_rendezvous_and_gloo_listeners(cluster, tmp_path):
    """torch as ray_mesh starts it under Ray Train: TCPStore on rank 0, gloo pairs."""
    port = free_port_in(cluster.head.exec_prefix(), cluster.head.ip)
    go = tmp_path / "go"
    procs = []
    for rank in (0, 1):
        node = cluster.nodes[rank]
        env = cluster.node_env(node)
        env.update(MASTER_ADDR=cluster.head.ip, MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="tailscale0", PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen(
            [*node.exec_prefix(), sys.executable, "-c", _TORCH, str(rank), str(go)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    try:
        for p in procs:
            assert p.stdout is not None
            seen_lines = []
            for line in p.stdout:  # torch may warn first
                seen_lines.append(line)
                if line.startswith("READY"):
                    break
            assert seen_lines and seen_lines[-1].startswith("READY"), "".join(seen_lines)
        rows0 = [r for r in listeners(cluster, 0) if r[0] == "torch"]
        rows1 = [r for r in listeners(cluster, 1) if r[0] == "torch"]
    finally:
        go.touch()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
    print("torch rank 0:", rows0, "\ntorch rank 1:", rows1)
    store = [r for r in rows0 if r[1] == port]
    # TCPStore: bound to MASTER_ADDR by ray_mesh (torch's own would be *:PORT)
    assert store and {r[2] for r in store} == {"tailnet address"}, rows0
    documented = {r for r in readme_table() if r[0] == "torch"}
    seen = _keyed(rows0 + rows1, documented)
    assert seen == documented, (seen, documented)


def _connect(prefix: list[str], address: str, port: int) -> str:
    """'ok', 'refused' or 'timeout: <the error>' (a timeout, no route, ...): a TCP connect to
    address:port from ``prefix``'s netns."""
    code = ("import socket,sys\ns=socket.socket();s.settimeout(3)\n"
            "try:\n s.connect((sys.argv[1], int(sys.argv[2])));print('ok')\n"
            "except ConnectionRefusedError: print('refused')\n"
            "except OSError as e: print('timeout:', repr(e))\n")
    out = subprocess.run([*prefix, sys.executable, "-c", code, address, str(port)],
                         capture_output=True, text=True, timeout=30)
    got = out.stdout.strip()
    return got if got in ("ok", "refused") or got.startswith("timeout:") else f"error {out.stderr}"


def _reach(prefix: list[str], address: str, port: int, within_s: float = 30.0) -> str:
    """:func:`_connect`, again while it times out, up to ``within_s``.

    The firewall answers with a TCP reset ('refused'), never with silence, so a timeout is
    the path, not the rule: over the WireGuard tunnel a SYN waits on two userspace
    ``wireguard-go`` processes, which a busy 2-core machine can starve for seconds."""
    deadline = time.monotonic() + within_s
    while ((got := _connect(prefix, address, port)).startswith("timeout")
           and time.monotonic() < deadline):
        time.sleep(0.5)
    return got


def _tunnel_state(net: NetnsCluster) -> str:
    """Each node's ``wg show`` (handshakes, transfer counters), addresses and routes: why a
    tunnel path is silent."""
    cmds = (["wg", "show"], ["ip", "-br", "addr"], ["ip", "route"])
    return "\n".join(f"node {i}: {' '.join(c)}\n{net.run_in(i, c).stdout}"
                     for i in range(len(net.nodes)) for c in cmds)


_LISTEN = """
import socket, sys, time
socks = []
for port in map(int, sys.argv[1:]):
    s = socket.socket(socket.AF_INET6)  # dual-stack *:port, as Ray's gRPC servers bind
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind(("::", port))
    s.listen(16)
    socks.append(s)
print("READY", flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def net():
    """Two namespaces without Ray: the firewall checks need only listeners."""
    if _REASON:
        pytest.skip(f"network namespaces unavailable: {_REASON}")
    with NetnsCluster([{}, {}], start_ray=False) as c:
        # A client on the decoy network: the host namespace gets an address next to eth0's.
        subprocess.run(["ip", "addr", "replace", f"{c.decoy_subnet}.254/24", "dev",
                        c.head.decoy_host], check=True, timeout=10)
        yield c


@pytest.mark.parametrize("backend", ["nft", "iptables"])
def test_firewall_admits_only_the_tailnet(net, backend):
    """firewall.sh inside node 0: decoy-network clients refused, tailnet and lo admitted."""
    if shutil.which(backend) is None:
        pytest.skip(f"{backend} is not installed (apt-get install -y nftables iptables)")
    head = net.head
    high, low = free_port_in(head.exec_prefix()), 80  # a Ray-like port; one below the range
    server = subprocess.Popen([*head.exec_prefix(), sys.executable, "-c", _LISTEN, str(high),
                               str(low)], stdout=subprocess.PIPE, text=True)
    env = {"RAY_MESH_FW_BACKEND": backend}
    try:
        assert server.stdout is not None and server.stdout.readline().startswith("READY")
        host, peer, local = [], net.nodes[1].exec_prefix(), head.exec_prefix()
        assert _connect(host, head.decoy_ip, high) == "ok"  # open before: all interfaces
        assert _reach(peer, head.ip, high) == "ok", _tunnel_state(net)  # the tunnel carries
        for _ in range(2):  # twice: the second apply replaces the first
            res = net.run_in(0, ["bash", str(FIREWALL), "apply"], env=env)
            assert res.returncode == 0, res.stderr
        status = net.run_in(0, ["bash", str(FIREWALL), "status"], env=env).stdout
        assert status.count("reject") == 1, status  # one rule: applying twice did not add
        assert _connect(host, head.decoy_ip, high) == "refused"  # off the tailnet
        assert _reach(peer, head.ip, high) == "ok", _tunnel_state(net)  # the tailnet peer
        assert _connect(local, head.ip, high) == "ok"  # the node itself (via lo)
        assert _connect(host, head.decoy_ip, low) == "ok"  # below 1024: untouched
        # IPv6 is covered too (Ray's servers bind [::] as well).
        v6 = net.run_in(0, ["ip6tables", "-S", "RAY_MESH"] if backend == "iptables" else
                        ["nft", "list", "table", "inet", "ray_mesh"])
        assert "fd7a:115c:a1e0::/48" in v6.stdout, v6.stdout + v6.stderr
    finally:
        res = net.run_in(0, ["bash", str(FIREWALL), "remove"], env=env)
        server.kill()
        server.wait(timeout=10)
    assert res.returncode == 0, res.stderr
    assert "not loaded" in net.run_in(0, ["bash", str(FIREWALL), "status"], env=env).stderr


def test_firewall_keeps_ray_working(cluster):
    """On the Ray cluster: GCS and /metrics refused off the tailnet, Ray still works."""
    _settled(cluster)
    head = cluster.head
    subprocess.run(["ip", "addr", "replace", f"{cluster.decoy_subnet}.254/24", "dev",
                    head.decoy_host], check=True, timeout=10)
    before = {p: _connect([], head.decoy_ip, p) for p in (6379, 44227)}
    assert before == {6379: "ok", 44227: "ok"}, before  # reachable off the tailnet
    try:
        res = cluster.run_in(0, ["bash", str(FIREWALL), "apply"])
        assert res.returncode == 0, res.stderr
        after = {p: _connect([], head.decoy_ip, p) for p in (6379, 44227)}
        assert after == {6379: "refused", 44227: "refused"}, after
        peer = {p: _reach(cluster.nodes[1].exec_prefix(), head.ip, p) for p in (6379, 44227)}
        assert peer == {6379: "ok", 44227: "ok"}, peer
        cluster.wait_for_nodes(2, timeout_s=60)  # a driver in the head namespace, both nodes
    finally:
        res = cluster.run_in(0, ["bash", str(FIREWALL), "remove"])
    assert res.returncode == 0, res.stderr


_HTTP = """
import sys, urllib.request, urllib.error
for url in sys.argv[1:]:
    try:
        code = urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as e:
        code = e.code
    except Exception as e:  # the agent's gRPC port speaks HTTP/2 only
        code = type(e).__name__
    print(code, url)
"""


def test_token_column_of_the_http_endpoints(cluster):
    """From the tailnet peer without a token: /metrics answer (200), the dashboard does not."""
    _settled(cluster)
    head = cluster.head
    agent_metrics = sorted(p for c, p, s, _ in listeners(cluster, 0)
                           if c == "dashboard agent" and s == "all interfaces")
    urls = [f"http://{head.ip}:{p}/metrics" for p in (44227, 44217, *agent_metrics)]
    urls += [f"http://{head.ip}:8265/api/jobs/", f"http://{head.ip}:52365/api/job_agent/jobs/"]
    out = cluster.run_in(1, [sys.executable, "-c", _HTTP, *urls], timeout=120).stdout
    print(out)
    codes = {url: code for code, url in (ln.split(" ", 1) for ln in out.splitlines())}
    assert codes[urls[0]] == "200" and codes[urls[1]] == "200", codes  # no token needed
    assert "200" in {codes[u] for u in urls[2:2 + len(agent_metrics)]}, codes
    assert codes[f"http://{head.ip}:8265/api/jobs/"] == "401", codes  # the token guards
    assert codes[f"http://{head.ip}:52365/api/job_agent/jobs/"] == "401", codes
