"""A virtual Tailscale cluster on one Linux machine, for tests and benchmarks.

Each "node" is a network namespace plus a private mount namespace
(:mod:`harness.netns.namespaces`) with:

* ``tailscale0`` holding an address in Tailscale's 100.64.0.0/10 range, on which Ray runs
  (``--node-ip-address``). Two modes (``tunnel=``):

  - ``"wireguard"`` (the default): a real WireGuard tun device (``wireguard-go``, keys
    made per run, MTU 1280, :mod:`harness.netns.wireguard`) whose packets travel over
    ``lan0``, a veth on a private bridge with a LAN address (172.16.0.0/12): a second
    interface that also reaches the peers, as a LAN beside the tailnet does. Encryption
    costs CPU: ~244 Mbit/s per tunnel on this 2-core machine against ~11 Gbit/s on veth.
  - ``"veth"``: ``tailscale0`` is itself the veth on the bridge (no tunnel, no ``lan0``).
    Fast; for tests whose point is not the tunnel (each says why).
* ``eth0``: a decoy on a network that reaches nobody (a veth whose other end is on no
  bridge). A library that picks the wrong interface hangs or fails here for real.
* private ``/tmp/ray-mesh-node``, ``~/ray_results``, ``/dev/shm``: a file one node writes
  there does not exist on another (no shared filesystem but the repository and the
  cluster's own folder, which stand for a network share).

Ray is started in every node with the project's own ``deploy/tailscale/ray-head.sh`` and
``ray-worker.sh`` (a stand-in ``tailscale`` command on PATH prints the node's address),
``--temp-dir`` inside the node's private disk, and custom resources that stand in for GPUs.
Drivers run inside the head (:meth:`NetnsCluster.run_python`).

Names and subnets derive from the test process's pid, so concurrent sessions do not
collide. :meth:`NetnsCluster.stop` kills exactly the processes of this cluster's namespaces
(``ip netns pids``), never ``ray stop``, then deletes namespaces, bridge and folders; it runs
even when a test fails.

Usage (from the repository root, or with it on ``PYTHONPATH``)::

    from harness.netns import NetnsCluster, netns_unavailable_reason

    if reason := netns_unavailable_reason():        # not root, no `ip netns`, ...
        pytest.skip(reason)
    with NetnsCluster(resources=[{"slot": 2}, {"slot": 2}]) as cluster:
        out = cluster.run_python("import ray; ray.init(); print(ray.nodes())")  # in head
        cluster.run_in(1, ["ip", "-br", "addr"])    # any command inside node 1
        cluster.cut_link(1); cluster.restore_link(1)  # node 1 off the bridge and back
        cluster.shape_link(1, 20)                   # node 1's link: 20 Mbit/s each way
        cluster.shape_pair(1, 2, 2)                 # only the 1 <-> 2 path: 2 Mbit/s
        cluster.set_link_mtu(2, 1300)               # frames over 1300 B to/from 2: dropped
        cluster.kill_node(1)                        # its Ray processes die (a crash)
        cluster.add_node({"slot": 2})               # a new node joins (elastic tests)

Shaping is ``tc ... tbf`` on the underlay (``netem``, ``fq``, ``sfq``, ``cake`` do not exist
on this kernel: no delay or loss can be added). Drivers get ``RAY_ADDRESS`` and
``RAY_AUTH_MODE=token`` (every node shares this machine's ``~/.ray/auth_token``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.netns import wireguard as wg
from harness.netns.agent import NamespaceAgent
from harness.netns.cpu import CPU_ROOT, cpu_quota_unavailable_reason, remove_cgroup
from harness.netns.links import LinkControls
from harness.netns.namespaces import (
    DECOY_IFACE,
    NODE_LOCAL,
    TAILNET_IFACE,
    UNDERLAY_IFACE,
    Node,
    check_rate,
    run,
    text,
)
from harness.netns.ray_nodes import start_ray_node, wait_for_nodes

REPO = Path(__file__).resolve().parents[2]
_instances = itertools.count()
TUNNELS = ("wireguard", "veth")
HOSTS_ROOT = Path("/etc/netns")  # ip netns exec: /etc/netns/<ns>/hosts is the node's /etc/hosts


class NetnsCluster(LinkControls):
    """Namespaces on a bridge with a real Ray node in each (see the module docstring).

    Args:
        resources: custom resources per node; its length is the node count.
        num_cpus: logical CPUs each node advertises.
        start_ray: False builds only the network (for pre-flight tests without Ray).
        env: extra environment for every ``ray start`` (and so every Ray worker).
        ray_start_timeout_s: bound on each node's start.
        dashboard: start the head's dashboard (bound to its tailnet address by the script).
        start_attempts: tries per node's ``ray start`` (a busy machine can time one out).
        ipv6: also give each tailscale0 an address in Tailscale's IPv6 range.
        link_mbit: cap every node's link at this rate (Mbit/s, each direction); None: unshaped.
        node_mbit: per-node caps that override ``link_mbit`` (e.g. ``{1: 20}``: a slow node).
        tunnel: ``"wireguard"`` (real WireGuard over a LAN underlay) or ``"veth"``.
        node_cpus: per-node CPU quotas in cores (e.g. ``{2: 0.3}``: a slower box;
            ``harness.netns.cpu``); the node's ``ray start`` and all it starts run under it.
    """

    def __init__(self, resources: list[dict[str, float]] | None = None, *, num_cpus: int = 2,
                 start_ray: bool = True, env: dict[str, str] | None = None,
                 ray_start_timeout_s: float = 120.0, dashboard: bool = False,
                 start_attempts: int = 2, ipv6: bool = False, link_mbit: float | None = None,
                 node_mbit: dict[int, float] | None = None, tunnel: str = "wireguard",
                 node_cpus: dict[int, float] | None = None) -> None:
        if tunnel not in TUNNELS:
            raise ValueError(f"tunnel={tunnel!r}: use one of {TUNNELS}")
        if tunnel == "wireguard" and (reason := wg.wireguard_unavailable_reason()):
            raise wg.WireGuardError(reason)
        self.tunnel = tunnel
        self.ipv6 = ipv6
        self.link_mbit = None if link_mbit is None else check_rate(link_mbit)
        self.node_mbit = {int(i): check_rate(r) for i, r in (node_mbit or {}).items()}
        self.dashboard = dashboard
        self.start_attempts = max(1, start_attempts)
        self.resources = resources or [{"slot": 2}, {"slot": 2}]
        if not 1 <= len(self.resources) <= 200:
            raise ValueError("a NetnsCluster has 1..200 nodes")
        self.num_cpus = num_cpus
        self.start_ray = start_ray
        self.env = dict(env or {})
        self.ray_start_timeout_s = ray_start_timeout_s
        pid = os.getpid()
        # pid + a per-process counter: two clusters of one process never share names. Linux
        # interface names are at most 15 characters: "rmv" + 8 + "n" + 3.
        seq = next(_instances) % 10
        self.tag = f"{pid % 10_000_000}{seq}"
        key = pid * 10 + seq
        a, b = key % 64, (key // 64) % 256
        self.subnet = f"100.{64 + a}.{b}"  # tailnet, inside 100.64.0.0/10
        self.decoy_subnet = f"10.{200 + a % 50}.{b}"
        self.lan_subnet = f"172.{16 + a % 16}.{b}"
        self.subnet6 = f"fd7a:115c:a1e0:{key % 0xFFFF:x}"
        self.bridge = f"rmb{self.tag}"
        self.root = Path(tempfile.mkdtemp(prefix=f"rmn{self.tag}_", dir="/tmp"))
        self.nodes: list[Node] = [self._make_node(i, r) for i, r in enumerate(self.resources)]
        if bad := sorted(i for i in self.node_mbit if not 0 <= i < len(self.nodes)):
            raise ValueError(f"node_mbit names nodes {bad}, but the cluster has nodes "
                             f"0..{len(self.nodes) - 1}")
        self.node_cpus = {int(i): float(c) for i, c in (node_cpus or {}).items()}
        if bad := sorted(i for i in self.node_cpus if not 0 <= i < len(self.nodes)):
            raise ValueError(f"node_cpus names nodes {bad}, but the cluster has nodes "
                             f"0..{len(self.nodes) - 1}")
        if self.node_cpus and (reason := cpu_quota_unavailable_reason()):
            raise RuntimeError(f"node_cpus: {reason}")
        self.bin_dir = self.root / "bin"
        self.publics: dict[int, str] = {}
        self.started = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> NetnsCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        """The Ray address drivers connect to (head's tailnet address and GCS port)."""
        return f"{self.head.ip}:6379"

    @property
    def link_iface(self) -> str:
        """The node-side end of each node's bridge veth (what shaping and MTU act on)."""
        return UNDERLAY_IFACE if self.tunnel == "wireguard" else TAILNET_IFACE

    def start(self) -> None:
        self.started = True
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            self._build_node(node)
        self._join_tunnel(self.nodes)
        for node in self.nodes:
            rate = self.node_mbit.get(node.index, self.link_mbit)
            if rate is not None:
                self.shape_link(node.index, rate)
        self._write_fake_tailscale()
        if self.start_ray:
            for node in self.nodes:
                self.start_ray_node(node.index)
            self.wait_for_nodes(len(self.nodes))

    def _write_hosts(self, node: Node) -> None:
        """MagicDNS's part of a tailnet (Tailscale's default): every node resolves every
        tailnet address to a name. Without it, torch's TCP store logs "The hostname of the
        client socket cannot be retrieved" for each connection it accepts (no DNS server
        answers inside a namespace). ``ip netns exec`` mounts this file over /etc/hosts in
        the node (the holder's mounts keep it); the host's own lines stay."""
        folder = HOSTS_ROOT / node.ns
        folder.mkdir(parents=True, exist_ok=True)
        base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        # torch's store listens on a dual-stack socket: a client is ::ffff:<IPv4>, and glibc
        # looks that form up as it is
        addresses = [(n, a) for n in self.nodes
                     for a in (n.ip, f"::ffff:{n.ip}", n.ip6) if a]
        names = [f"{a} node{n.index}.tailnet.ts.net node{n.index}" for n, a in addresses]
        (folder / "hosts").write_text(base.rstrip("\n") + "\n" + "\n".join(names) + "\n")

    def _make_node(self, i: int, resources: dict[str, float]) -> Node:
        return Node(i, f"rmn{self.tag}n{i}", f"{self.subnet}.{i + 1}",
                    f"{self.decoy_subnet}.{i + 1}", f"rmv{self.tag}n{i}", f"rmd{self.tag}n{i}",
                    NODE_LOCAL / "ray", dict(resources),
                    f"{self.subnet6}::{i + 1}" if self.ipv6 else "",
                    f"{self.lan_subnet}.{i + 1}" if self.tunnel == "wireguard" else "")

    def _build_node(self, node: Node) -> None:
        run(["ip", "netns", "add", node.ns])
        self._write_hosts(node)
        node.start_holder()
        ns = node.exec_prefix()
        peer = f"rmp{self.tag}n{node.index}"
        run(["ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", peer])
        run(["ip", "link", "set", node.host_veth, "master", self.bridge])
        run(["ip", "link", "set", node.host_veth, "up"])
        run(["ip", "link", "set", peer, "netns", node.ns])
        run([*ns, "ip", "link", "set", peer, "name", self.link_iface])
        if self.tunnel == "wireguard":
            run([*ns, "ip", "addr", "add", f"{node.lan_ip}/24", "dev", UNDERLAY_IFACE])
        else:
            run([*ns, "ip", "addr", "add", f"{node.ip}/24", "dev", TAILNET_IFACE])
            if node.ip6:  # nodad: usable at once, no duplicate-address wait
                run([*ns, "ip", "-6", "addr", "add", f"{node.ip6}/64", "dev", TAILNET_IFACE,
                     "nodad"])
        run([*ns, "ip", "link", "set", self.link_iface, "up"])
        run([*ns, "ip", "link", "set", "lo", "up"])
        # The decoy: a veth whose other end is up in the host namespace but on no bridge.
        decoy_peer = f"rmq{self.tag}n{node.index}"
        run(["ip", "link", "add", node.decoy_host, "type", "veth", "peer", "name", decoy_peer])
        run(["ip", "link", "set", node.decoy_host, "up"])
        run(["ip", "link", "set", decoy_peer, "netns", node.ns])
        run([*ns, "ip", "link", "set", decoy_peer, "name", DECOY_IFACE])
        run([*ns, "ip", "addr", "add", f"{node.decoy_ip}/24", "dev", DECOY_IFACE])
        run([*ns, "ip", "link", "set", DECOY_IFACE, "up"])

    def _join_tunnel(self, new: list[Node]) -> None:
        """WireGuard mode: start ``new`` nodes' devices, make every pair peers, and wait
        (bounded) for every handshake."""
        if self.tunnel != "wireguard":
            return
        for node in new:
            keys = wg.make_keys(self.root / "keys", f"n{node.index}")
            self.publics[node.index] = keys.public
            wg.start_device(node, keys)
        for node in self.nodes:
            for peer in self.nodes:
                if peer is not node and (node in new or peer in new):
                    wg.add_peer(node, peer, self.publics[peer.index])
        wg.wait_for_handshakes(self.nodes, self.publics)

    def _write_fake_tailscale(self) -> None:
        """A `tailscale` stand-in: `tailscale ip -4` prints this namespace's tailnet address."""
        self.bin_dir.mkdir(exist_ok=True)
        script = self.bin_dir / "tailscale"
        script.write_text(f"""#!/usr/bin/env bash
# Stand-in for the Tailscale CLI inside a ray_mesh test namespace.
if [[ "$1" == "ip" ]]; then
    ip -4 -o addr show dev {TAILNET_IFACE} | awk '{{split($4, a, "/"); print a[1]}}'
    exit 0
fi
echo "fake tailscale: only 'ip' is supported" >&2
exit 1
""")
        script.chmod(0o755)

    def node_env(self, node: Node) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PATH=f"{self.bin_dir}:{env.get('PATH', '')}",
            RAY_BLOCK="0",
            RAY_MESH_ENV_FILE="none",  # ray_mesh sets NCCL/gloo env itself in the tests
            RAY_DEDUP_LOGS="0",
            # Token auth stays on; drivers and `ray start --address` need the mode set
            # explicitly to send the shared ~/.ray/auth_token.
            RAY_AUTH_MODE="token",
            TMPDIR=str(NODE_LOCAL / "tmp"),  # scratch on the node's own disk
        )
        env.pop("RAY_ADDRESS", None)  # never someone else's cluster
        env.update(self.env)
        return env

    def start_ray_node(self, index: int) -> subprocess.CompletedProcess:
        """``ray start`` in node ``index`` through the deploy scripts (head for index 0)."""
        return start_ray_node(self, index)

    def wait_for_nodes(self, count: int, timeout_s: float = 90.0) -> None:
        """Block until ``count`` nodes are alive in the cluster (bounded)."""
        wait_for_nodes(self, count, timeout_s)

    def stop(self) -> None:
        """Kill every process in the namespaces, delete them and the bridge (idempotent).

        SIGKILL at once, every node together: the cluster is being thrown away."""
        for node in self.nodes:
            for pid in node.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for node in self.nodes:
            node.kill_work(everything=True)  # whatever is left (bounded)
            node.reap()
        for node in self.nodes:
            run(["ip", "netns", "del", node.ns], check=False)
            shutil.rmtree(HOSTS_ROOT / node.ns, ignore_errors=True)
            run(["ip", "link", "del", node.host_veth], check=False)
            run(["ip", "link", "del", node.decoy_host], check=False)
        run(["ip", "link", "del", self.bridge], check=False)
        for i in self.node_cpus:
            remove_cgroup(CPU_ROOT / self.nodes[i].ns)
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def namespace_pids(ns: str) -> list[int]:
        proc = run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]

    def add_node(self, resources: dict[str, float] | None = None,
                 start_ray: bool = True) -> Node:
        """A new node on the bridge (a tunnel peer of every node), joined to the cluster."""
        if len(self.nodes) >= 200:
            raise ValueError("a NetnsCluster has at most 200 nodes")
        node = self._make_node(len(self.nodes), resources or dict(self.resources[-1]))
        self.nodes.append(node)
        self._build_node(node)
        self._join_tunnel([node])
        if start_ray:
            self.start_ray_node(node.index)
            self.wait_for_nodes(sum(1 for n in self.nodes if n.work_pids()))
        return node

    def kill_node(self, index: int) -> None:
        """Kill every process of node ``index`` (a crashed Ray node); its network stays."""
        self.nodes[index].kill_work()

    def agent(self, index: int) -> NamespaceAgent:
        """A Ray-free helper process in node ``index`` that runs Python functions there."""
        return NamespaceAgent(self.nodes[index], self.node_env(self.nodes[index]))

    # ------------------------------------------------------------------ use
    def run_in(self, index: int, cmd: list[str], *, timeout: float = 60, check: bool = False,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside node ``index`` (its network and its private files)."""
        node = self.nodes[index]
        full_env = self.node_env(node)
        full_env.update(env or {})
        return subprocess.run([*node.exec_prefix(), *cmd], capture_output=True, text=True,
                              timeout=timeout, check=check, env=full_env)

    def run_python(self, code: str, *, node: int = 0, timeout: float = 300,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a Python driver inside a node (the head by default).

        Raises with the driver's output if it exits non-zero or runs past ``timeout``.
        """
        script = self.root / f"driver_{time.monotonic_ns()}.py"
        script.write_text(code)
        full_env = {"RAY_ADDRESS": self.address, "PYTHONPATH": str(REPO),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            proc = self.run_in(node, [sys.executable, str(script)], timeout=timeout,
                               env=full_env)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"driver ran past {timeout} s:\n{text(exc.stdout)}\n"
                               f"{text(exc.stderr)}") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"driver failed (rc {proc.returncode}):\n{proc.stdout}\n"
                               f"{proc.stderr}")
        return proc


__all__ = ["REPO", "TUNNELS", "NetnsCluster"]
