"""deploy/tailscale/firewall.sh with a peer list, applied in a network namespace (issue
"Security, round 2", items 2 and 5). No Ray: the rules only need listeners.

Three tailnet nodes (IPv4 and IPv6 on ``tailscale0``) and a client on the decoy network.
Node 0 runs a listener on a high port and applies the firewall with node 1 as its only peer:

* node 1 (listed) connects, over IPv4 and IPv6; node 2, another tailnet member not listed,
  is refused, as is the off-tailnet client; node 0 itself still connects;
* re-applying is atomic: while ``apply`` runs again and again, a client that must be refused
  never gets through and the listed peer is never refused (the old iptables recipe flushed
  the chain, then added the rules one command at a time: every re-apply opened a window);
* a bad peer or port list changes nothing: the loaded rules stay as they were.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from ports import free_port_in  # noqa: E402

from harness.netns import REPO, NetnsCluster, netns_unavailable_reason  # noqa: E402

pytestmark = pytest.mark.netns

FIREWALL = REPO / "deploy" / "tailscale" / "firewall.sh"
BACKENDS = ["nft", "iptables"]

_LISTEN = """
import socket, sys, threading, time
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # *:port on v4 and v6, as Ray's
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", int(sys.argv[1])))
s.listen(512)
def serve():
    while True:
        c, _ = s.accept()
        c.close()
threading.Thread(target=serve, daemon=True).start()
print("READY", flush=True)
time.sleep(600)
"""

# Connect to ADDR:PORT until the file STOP exists; counts of each outcome as JSON.
_PROBE = """
import json, os, socket, sys, time
addr, port, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
counts = {"ok": 0, "refused": 0, "other": 0}
print("READY", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(stop) and time.monotonic() < deadline:
    s = socket.socket(fam)
    s.settimeout(2)
    try:
        s.connect((addr, port))
        counts["ok"] += 1
    except ConnectionRefusedError:
        counts["refused"] += 1
    except OSError:
        counts["other"] += 1
    finally:
        s.close()
print(json.dumps(counts), flush=True)
"""


def _connect(prefix: list[str], address: str, port: int) -> str:
    code = ("import socket,sys\na=sys.argv[1]\n"
            "s=socket.socket(socket.AF_INET6 if ':' in a else socket.AF_INET);s.settimeout(3)\n"
            "try:\n s.connect((a, int(sys.argv[2])));print('ok')\n"
            "except ConnectionRefusedError: print('refused')\n"
            "except OSError as e: print('timeout', e)\n")
    out = subprocess.run([*prefix, sys.executable, "-c", code, address, str(port)],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.split()[0] if out.stdout else f"error {out.stderr}"


@pytest.fixture(scope="module")
def net():
    if reason := netns_unavailable_reason():
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NetnsCluster([{}, {}, {}], start_ray=False, ipv6=True) as c:
        # A client off the tailnet: the host namespace gets an address next to node 0's eth0.
        subprocess.run(["ip", "addr", "replace", f"{c.decoy_subnet}.254/24", "dev",
                        c.head.decoy_host], check=True, timeout=10)
        port = free_port_in(c.head.exec_prefix())
        server = subprocess.Popen([*c.head.exec_prefix(), sys.executable, "-c", _LISTEN,
                                   str(port)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None and server.stdout.readline().startswith("READY")
            yield c, port
        finally:
            server.kill()
            server.wait(timeout=10)


def _fw(net: NetnsCluster, action: str, backend: str, **env: str):
    full = {"RAY_MESH_FW_BACKEND": backend, "RAY_MESH_FW_PEERS_FILE": "/nonexistent", **env}
    return net.run_in(0, ["bash", str(FIREWALL), action], env=full)


def _need(backend: str) -> None:
    if shutil.which(backend) is None:
        pytest.skip(f"{backend} is not installed (apt-get install -y nftables iptables)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_listed_peers_get_in(net, backend):
    _need(backend)
    c, port = net
    head, listed, other = c.nodes
    peers = f"{listed.ip} {listed.ip6}"
    assert _connect(other.exec_prefix(), head.ip, port) == "ok"  # open before
    try:
        res = _fw(c, "apply", backend, RAY_MESH_FW_PEERS=peers)
        assert res.returncode == 0, res.stderr
        seen = {
            "listed v4": _connect(listed.exec_prefix(), head.ip, port),
            "listed v6": _connect(listed.exec_prefix(), head.ip6, port),
            "unlisted tailnet v4": _connect(other.exec_prefix(), head.ip, port),
            "unlisted tailnet v6": _connect(other.exec_prefix(), head.ip6, port),
            "off the tailnet": _connect([], head.decoy_ip, port),
            "the node itself": _connect(head.exec_prefix(), head.ip, port),
        }
        assert seen == {"listed v4": "ok", "listed v6": "ok", "unlisted tailnet v4": "refused",
                        "unlisted tailnet v6": "refused", "off the tailnet": "refused",
                        "the node itself": "ok"}, seen
        # A bad list changes nothing: exit 2, and the loaded rules still hold.
        before = _fw(c, "status", backend).stdout
        for bad in ({"RAY_MESH_FW_PEERS": "100.64.0.999"}, {"RAY_MESH_FW_PORTS": "0-65535"},
                    {"RAY_MESH_FW_OPEN": "22 x"}):
            res = _fw(c, "apply", backend, **{"RAY_MESH_FW_PEERS": peers, **bad})
            assert res.returncode == 2, (bad, res.stderr)
        assert _fw(c, "status", backend).stdout == before
        assert _connect(other.exec_prefix(), head.ip, port) == "refused"
    finally:
        res = _fw(c, "remove", backend)
    assert res.returncode == 0, res.stderr
    assert _connect(other.exec_prefix(), head.ip, port) == "ok"  # removed: open again


def _probe(prefix: list[str], address: str, port: int, stop: Path) -> subprocess.Popen:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", _PROBE, address, str(port),
                             str(stop)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().startswith("READY")
    return proc


@pytest.mark.parametrize("backend", BACKENDS)
def test_reapply_is_atomic(net, backend, tmp_path):
    _need(backend)
    c, port = net
    head, listed, other = c.nodes
    env = {"RAY_MESH_FW_PEERS": listed.ip}
    try:
        res = _fw(c, "apply", backend, **env)
        assert res.returncode == 0, res.stderr
        stop = tmp_path / "stop"
        probes = {"off the tailnet": _probe([], head.decoy_ip, port, stop),
                  "unlisted": _probe(other.exec_prefix(), head.ip, port, stop),
                  "listed": _probe(listed.exec_prefix(), head.ip, port, stop)}
        applies, start = 0, time.monotonic()
        try:
            while applies < 15 or time.monotonic() - start < 3:
                res = _fw(c, "apply", backend, **env)
                assert res.returncode == 0, res.stderr
                applies += 1
        finally:
            stop.touch()
        counts = {name: json.loads(p.communicate(timeout=30)[0].splitlines()[-1])
                  for name, p in probes.items()}
        print(f"{applies} re-applies ({backend}):", counts)
        assert counts["off the tailnet"]["ok"] == 0, counts
        assert counts["unlisted"]["ok"] == 0, counts
        assert counts["listed"]["refused"] == 0 and counts["listed"]["other"] == 0, counts
        # The probes really ran during the re-applies (else nothing above was checked).
        assert all(sum(v.values()) > 10 * applies for v in counts.values()), counts
        status = _fw(c, "status", backend).stdout
        rejects = [ln for ln in status.splitlines() if "reject" in ln.lower()]
        assert len(rejects) == 1, status  # replaced, never stacked
    finally:
        res = _fw(c, "remove", backend)
    assert res.returncode == 0, res.stderr
