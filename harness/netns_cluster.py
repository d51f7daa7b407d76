"""A virtual Tailscale cluster on one Linux machine, for tests and benchmarks.

Each "node" is a network namespace with:

* ``tailscale0``: one end of a veth pair (the other end sits on a private bridge in the
  host namespace), holding an address in Tailscale's 100.64.0.0/10 range; all nodes reach
  each other over it, and Ray runs on it (``--node-ip-address``).
* ``eth0``: a decoy on a different network (a veth whose other end is on no bridge, so
  the other nodes' decoy addresses never answer). A library that picks the wrong
  interface hangs or fails here for real, as on a box with eth0, docker0 and tailscale0.
* ``lo`` up.

Ray is started in every namespace with the project's own ``deploy/tailscale/ray-head.sh``
and ``ray-worker.sh`` (a stand-in ``tailscale`` command on PATH prints the namespace's
address), each node with its own ``--temp-dir`` and custom resources that stand in for GPUs
(Ray packs CPU-only workers onto one node otherwise). Drivers run inside the head
namespace (:meth:`NetnsCluster.run_python`).

Names (namespaces, bridge, veths) and subnets derive from the test process's pid, so
concurrent sessions do not collide. :meth:`NetnsCluster.stop` kills exactly the processes
that live in this cluster's namespaces (``ip netns pids``), never ``ray stop``, then deletes
the namespaces, the bridge and the temp dirs; it runs even when a test fails.

Usage (from the repository root, or with it on ``PYTHONPATH``)::

    from harness.netns_cluster import NetnsCluster, netns_unavailable_reason

    if reason := netns_unavailable_reason():        # not root, no `ip netns`, ...
        pytest.skip(reason)
    with NetnsCluster(resources=[{"slot": 2}, {"slot": 2}]) as cluster:
        out = cluster.run_python("import ray; ray.init(); print(ray.nodes())")  # in head ns
        cluster.run_in(1, ["ip", "-br", "addr"])    # any command inside node 1
        before = cluster.interface_counters(1)      # tailscale0 rx/tx bytes and packets
        cluster.cut_link(1)                         # node 1 drops off the bridge
        cluster.restore_link(1)
        cluster.shape_link(1, 20)                   # node 1's link: 20 Mbit/s each way
        cluster.kill_node(1)                        # its Ray processes die (a crash)
        cluster.add_node({"slot": 2})               # a new node joins (elastic tests)

Shaped links: ``NetnsCluster(link_mbit=100, node_mbit={1: 20})`` (or :meth:`shape_link` later)
puts a ``tc ... tbf`` qdisc on both ends of a node's veth, so its traffic in and out is capped
(set 100 Mbit/s measured ~97, 20 Mbit/s ~22 by a 3 s TCP transfer). This kernel has no
``netem``, ``fq``, ``sfq`` or ``cake``, so no delay or loss can be added: latency is a
parameter of the planner's cost model, not of the fixture.

Drivers get ``RAY_ADDRESS`` (``cluster.address``) and ``RAY_AUTH_MODE=token``; workers run
with one ``--temp-dir`` per node under ``cluster.root``.

Ray token authentication (on by default in Ray 2.60) is left on: every namespace shares
this machine's ``~/.ray/auth_token``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_instances = itertools.count()
DEPLOY = REPO / "deploy" / "tailscale"
TAILNET_IFACE = "tailscale0"
DECOY_IFACE = "eth0"


def netns_unavailable_reason() -> str | None:
    """Why a namespace cluster cannot run here (None when it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    if shutil.which("ip") is None:
        return "the `ip` command is not installed (apt-get install -y iproute2)"
    name = f"rmchk{os.getpid()}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True,
                       timeout=10)
        subprocess.run(["ip", "netns", "del", name], check=True, capture_output=True,
                       timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        return f"`ip netns add` does not work here: {err.decode(errors='replace') or exc}"
    return None


# Inside a namespace: wait until every address answers TCP (a refusal is an answer).
_REACH_SCRIPT = """
import errno, socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
pending = set(sys.argv[2:])
last = {}
while pending and time.monotonic() < deadline:
    for addr in sorted(pending):
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(fam) as s:
            s.settimeout(1.0)
            code = s.connect_ex((addr, 9))
        if code in (0, errno.ECONNREFUSED):
            pending.discard(addr)
        else:
            last[addr] = errno.errorcode.get(code, code)
    if pending:
        time.sleep(0.2)
if pending:
    left = sorted((a, last.get(a)) for a in pending)
    sys.exit(f"still unreachable after {sys.argv[1]} s: {left}")
"""


def _run(cmd: list[str], *, check: bool = True, timeout: float = 30,
         **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {proc.stderr}")
    return proc


@dataclass
class Node:
    """One namespace node."""

    index: int
    ns: str
    ip: str  # on tailscale0
    decoy_ip: str  # on eth0 (the decoy)
    host_veth: str  # the bridge end, in the host namespace
    decoy_host: str  # the decoy's other end, in the host namespace, on no bridge
    temp_dir: Path
    resources: dict[str, float] = field(default_factory=dict)
    ip6: str = ""  # on tailscale0 too, in fd7a:115c:a1e0::/48, when the cluster has IPv6

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


class NetnsCluster:
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
    """

    def __init__(
        self,
        resources: list[dict[str, float]] | None = None,
        *,
        num_cpus: int = 2,
        start_ray: bool = True,
        env: dict[str, str] | None = None,
        ray_start_timeout_s: float = 120.0,
        dashboard: bool = False,
        start_attempts: int = 2,
        ipv6: bool = False,
        link_mbit: float | None = None,
        node_mbit: dict[int, float] | None = None,
    ) -> None:
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
        # 100.(64+a).b.0/24 inside Tailscale's 100.64.0.0/10; 10.x.b.0/24 for the decoys.
        key = pid * 10 + seq
        a, b = key % 64, (key // 64) % 256
        self.subnet = f"100.{64 + a}.{b}"
        self.decoy_subnet = f"10.{200 + a % 50}.{b}"
        self.subnet6 = f"fd7a:115c:a1e0:{key % 0xFFFF:x}"
        self.bridge = f"rmb{self.tag}"
        self.root = Path(tempfile.mkdtemp(prefix=f"rmn{self.tag}_", dir="/tmp"))
        self.nodes: list[Node] = [self._make_node(i, r) for i, r in enumerate(self.resources)]
        if bad := sorted(i for i in self.node_mbit if not 0 <= i < len(self.nodes)):
            raise ValueError(f"node_mbit names nodes {bad}, but the cluster has nodes "
                             f"0..{len(self.nodes) - 1}")
        self.bin_dir = self.root / "bin"
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

    def start(self) -> None:
        self.started = True
        self._build_network()
        if self.start_ray:
            for node in self.nodes:
                self.start_ray_node(node.index)
            self.wait_for_nodes(len(self.nodes))

    def _build_network(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            self._build_node(node)
            rate = self.node_mbit.get(node.index, self.link_mbit)
            if rate is not None:
                self.shape_link(node.index, rate)
        self._write_fake_tailscale()

    def _make_node(self, i: int, resources: dict[str, float]) -> Node:
        return Node(i, f"rmn{self.tag}n{i}", f"{self.subnet}.{i + 1}",
                    f"{self.decoy_subnet}.{i + 1}", f"rmv{self.tag}n{i}", f"rmd{self.tag}n{i}",
                    self.root / f"n{i}", dict(resources),
                    f"{self.subnet6}::{i + 1}" if self.ipv6 else "")

    def _build_node(self, node: Node) -> None:
        _run(["ip", "netns", "add", node.ns])
        peer = f"rmp{self.tag}n{node.index}"
        _run(["ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", peer])
        _run(["ip", "link", "set", node.host_veth, "master", self.bridge])
        _run(["ip", "link", "set", node.host_veth, "up"])
        _run(["ip", "link", "set", peer, "netns", node.ns])
        ns = node.exec_prefix()
        _run([*ns, "ip", "link", "set", peer, "name", TAILNET_IFACE])
        _run([*ns, "ip", "addr", "add", f"{node.ip}/24", "dev", TAILNET_IFACE])
        if node.ip6:  # nodad: usable at once, no duplicate-address wait
            _run([*ns, "ip", "-6", "addr", "add", f"{node.ip6}/64", "dev", TAILNET_IFACE,
                  "nodad"])
        _run([*ns, "ip", "link", "set", TAILNET_IFACE, "up"])
        _run([*ns, "ip", "link", "set", "lo", "up"])
        # The decoy: a veth whose other end is up in the host namespace but on no
        # bridge, so the other nodes' decoy addresses never answer.
        decoy_peer = f"rmq{self.tag}n{node.index}"
        _run(["ip", "link", "add", node.decoy_host, "type", "veth", "peer", "name",
              decoy_peer])
        _run(["ip", "link", "set", node.decoy_host, "up"])
        _run(["ip", "link", "set", decoy_peer, "netns", node.ns])
        _run([*ns, "ip", "link", "set", decoy_peer, "name", DECOY_IFACE])
        _run([*ns, "ip", "addr", "add", f"{node.decoy_ip}/24", "dev", DECOY_IFACE])
        _run([*ns, "ip", "link", "set", DECOY_IFACE, "up"])
        node.temp_dir.mkdir(parents=True, exist_ok=True)

    def _write_fake_tailscale(self) -> None:
        """A `tailscale` stand-in: `tailscale ip -4` prints this namespace's tailnet address."""
        self.bin_dir.mkdir(exist_ok=True)
        script = self.bin_dir / "tailscale"
        script.write_text(textwrap.dedent(f"""\
            #!/usr/bin/env bash
            # Stand-in for the Tailscale CLI inside a ray_mesh test namespace.
            if [[ "$1" == "ip" ]]; then
                ip -4 -o addr show dev {TAILNET_IFACE} | awk '{{split($4, a, "/"); print a[1]}}'
                exit 0
            fi
            echo "fake tailscale: only 'ip' is supported" >&2
            exit 1
        """))
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
        )
        # Never inherit an address that points at someone else's cluster.
        env.pop("RAY_ADDRESS", None)
        env.update(self.env)
        return env

    def start_ray_node(self, index: int) -> subprocess.CompletedProcess:
        """``ray start`` in node ``index`` through the deploy scripts (head for index 0)."""
        node = self.nodes[index]
        extra = [
            f"--temp-dir={node.temp_dir}",
            f"--num-cpus={self.num_cpus}",
            "--num-gpus=0",
            f"--resources={json.dumps(node.resources)}",
            "--object-store-memory=100000000",
        ]
        if index == 0:
            cmd = [str(DEPLOY / "ray-head.sh"), *extra,
                   f"--include-dashboard={str(self.dashboard).lower()}"]
        else:
            cmd = [str(DEPLOY / "ray-worker.sh"), self.address, *extra]
        # `ray start` gives a raylet a fixed 30 s to register; on a machine shared with
        # other test runs that can pass, so a failed start is cleaned up and tried again.
        for attempt in range(self.start_attempts):
            proc = subprocess.run([*node.exec_prefix(), *cmd], capture_output=True, text=True,
                                  timeout=self.ray_start_timeout_s, env=self.node_env(node))
            if proc.returncode == 0:
                return proc
            self._kill_namespace_processes(node.ns)
            if attempt + 1 < self.start_attempts:
                shutil.rmtree(node.temp_dir, ignore_errors=True)
                node.temp_dir.mkdir(parents=True)
        raise RuntimeError(f"ray start on node {index} ({node.ns}) failed "
                           f"{self.start_attempts} times; last (rc {proc.returncode}):\n"
                           f"{proc.stdout}\n{proc.stderr}")

    def wait_for_nodes(self, count: int, timeout_s: float = 90.0) -> None:
        """Block until ``count`` nodes are alive in the cluster (bounded)."""
        code = textwrap.dedent(f"""\
            import time, ray
            ray.init(address={self.address!r}, log_to_driver=False)
            deadline = time.monotonic() + {timeout_s}
            while time.monotonic() < deadline:
                alive = [n for n in ray.nodes() if n["Alive"]]
                if len(alive) >= {count}:
                    print("ALIVE", len(alive)); break
                time.sleep(0.5)
            else:
                raise SystemExit(f"only {{len(alive)}} of {count} nodes alive")
        """)
        self.run_python(code, timeout=timeout_s + 30)

    def stop(self) -> None:
        """Kill every process in the namespaces, delete them and the bridge (idempotent).

        SIGKILL at once, every node together: the cluster is being thrown away, and Ray's
        processes spend seconds on a SIGTERM (a graceful ``kill_node`` is not the point)."""
        for node in self.nodes:
            for pid in self.namespace_pids(node.ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for node in self.nodes:
            self._kill_namespace_processes(node.ns)  # whatever is left (bounded)
        for node in self.nodes:
            _run(["ip", "netns", "del", node.ns], check=False)
            _run(["ip", "link", "del", node.host_veth], check=False)
            _run(["ip", "link", "del", node.decoy_host], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def namespace_pids(ns: str) -> list[int]:
        proc = _run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]

    def _kill_namespace_processes(self, ns: str, timeout_s: float = 10.0) -> None:
        # Only processes inside this cluster's own namespaces: nothing else lives there.
        sig = signal.SIGTERM
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.namespace_pids(ns)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(0.5)
            if time.monotonic() > deadline - timeout_s / 2:
                sig = signal.SIGKILL
            if time.monotonic() > deadline:
                return

    def add_node(self, resources: dict[str, float] | None = None,
                 start_ray: bool = True) -> Node:
        """A new namespace node on the bridge, joined to the cluster (elastic tests)."""
        if len(self.nodes) >= 200:
            raise ValueError("a NetnsCluster has at most 200 nodes")
        node = self._make_node(len(self.nodes), resources or dict(self.resources[-1]))
        self.nodes.append(node)
        self._build_node(node)
        if start_ray:
            self.start_ray_node(node.index)
            self.wait_for_nodes(sum(1 for n in self.nodes if self.namespace_pids(n.ns)))
        return node

    def kill_node(self, index: int) -> None:
        """Kill every process of node ``index`` (a crashed machine); its network stays."""
        self._kill_namespace_processes(self.nodes[index].ns)

    def agent(self, index: int) -> NamespaceAgent:
        """A Ray-free helper process in node ``index`` that runs Python functions there."""
        return NamespaceAgent(self.nodes[index], self.node_env(self.nodes[index]))

    # ------------------------------------------------------------------ use
    def run_in(self, index: int, cmd: list[str], *, timeout: float = 60, check: bool = False,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside node ``index``'s namespace."""
        node = self.nodes[index]
        full_env = self.node_env(node)
        full_env.update(env or {})
        return subprocess.run([*node.exec_prefix(), *cmd], capture_output=True, text=True,
                              timeout=timeout, check=check, env=full_env)

    def run_python(self, code: str, *, node: int = 0, timeout: float = 300,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a Python driver inside a node's namespace (the head by default).

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
            raise RuntimeError(f"driver ran past {timeout} s:\n{_text(exc.stdout)}\n"
                               f"{_text(exc.stderr)}") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"driver failed (rc {proc.returncode}):\n{proc.stdout}\n"
                               f"{proc.stderr}")
        return proc

    def cut_link(self, index: int) -> None:
        """Take node ``index`` off the bridge: its tailscale0 stays up but reaches no one."""
        _run(["ip", "link", "set", self.nodes[index].host_veth, "down"])

    def restore_link(self, index: int, timeout_s: float = 15.0) -> None:
        """Put node ``index`` back on the bridge and wait until it reaches every other node.

        Neighbour entries that failed while the link was cut would answer "no route to
        host" for a while (IPv6 most visibly), so every node forgets them, and the return
        waits (bounded) until node ``index`` gets an answer from every peer address.
        """
        _run(["ip", "link", "set", self.nodes[index].host_veth, "up"])
        for node in self.nodes:
            for family in ("-4", "-6"):
                _run([*node.exec_prefix(), "ip", family, "neigh", "flush", "dev",
                      TAILNET_IFACE], check=False)
        peers = [a for n in self.nodes if n.index != index for a in (n.ip, n.ip6) if a]
        _run([*self.nodes[index].exec_prefix(), sys.executable, "-c", _REACH_SCRIPT,
              str(timeout_s), *peers], timeout=timeout_s + 15)

    def shape_link(self, index: int, mbit: float) -> None:
        """Cap node ``index``'s link at ``mbit`` Mbit/s in both directions (``tc ... tbf``).

        One token bucket on each end of the veth: the bridge end shapes what the node
        receives, ``tailscale0`` inside the namespace what it sends. The queue bound is
        400 ms. The bucket holds 2 ms of the rate (8 KiB at least): a VPN link gives no
        credit after it idles, and a larger bucket does: with 64 KiB, a 200 kB send after
        100 ms idle went at 27.7 Mbit/s over a 20 Mbit/s link (+38%) and 136 over 100;
        with this bucket at 19.8 and 98 (sustained: 19.1, 95.7, 895 at 1 Gbit/s).
        """
        mbit = check_rate(mbit)
        rate, burst = f"{mbit:g}mbit", f"{max(8, round(mbit * 1e6 / 8 * 0.002 / 1024))}kb"
        node = self.nodes[index]
        for prefix, dev in (([], node.host_veth), (node.exec_prefix(), TAILNET_IFACE)):
            _run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                  "burst", burst, "latency", "400ms"])

    def unshape_link(self, index: int) -> None:
        """Remove node ``index``'s rate cap (both ends)."""
        node = self.nodes[index]
        for prefix, dev in (([], node.host_veth), (node.exec_prefix(), TAILNET_IFACE)):
            _run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    def interface_counters(self, index: int, iface: str = TAILNET_IFACE) -> dict[str, int]:
        """Byte/packet counters of ``iface`` in node ``index`` (e.g. bytes across nodes)."""
        proc = _run([*self.nodes[index].exec_prefix(), "ip", "-s", "-j", "link", "show",
                     "dev", iface])
        stats = json.loads(proc.stdout)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}


class NamespaceAgent:
    """A Python process inside one namespace that runs module-level functions on request.

    For Ray-free checks across nodes (e.g. the pre-flight's worker-side steps): state such
    as open listeners lives on in the process between calls. Requests and answers are
    pickles, one length-prefixed frame each, over the process's stdin/stdout.
    """

    _SERVER = textwrap.dedent("""\
        import pickle, struct, sys
        inp, out = sys.stdin.buffer, sys.stdout.buffer
        sys.stdout = sys.stderr
        while True:
            head = inp.read(4)
            if len(head) < 4:
                break
            fn, args = pickle.loads(inp.read(struct.unpack(">I", head)[0]))
            try:
                reply = ("ok", fn(*args))
            except Exception as exc:
                reply = ("error", f"{type(exc).__name__}: {exc}")
            data = pickle.dumps(reply)
            out.write(struct.pack(">I", len(data)) + data)
            out.flush()
    """)

    def __init__(self, node: Node, env: dict[str, str]) -> None:
        env = {**env, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([*node.exec_prefix(), sys.executable, "-c", self._SERVER],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()

    def call(self, fn, *args):
        """Run ``fn(*args)`` in the namespace; returns its value or raises RuntimeError."""
        data = pickle.dumps((fn, args))
        with self.lock:
            assert self.proc.stdin and self.proc.stdout
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
            head = self.proc.stdout.read(4)
            if len(head) < 4:
                raise RuntimeError("the namespace agent exited")
            status, value = pickle.loads(self.proc.stdout.read(struct.unpack(">I", head)[0]))
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def check_rate(mbit: object) -> float:
    """A link rate in Mbit/s: a finite number > 0 (``tc`` would take 0 as "no limit")."""
    try:
        rate = float(mbit)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"link rate {mbit!r} is not a number of Mbit/s (e.g. 100 or 20)") \
            from None
    if isinstance(mbit, bool) or not 0 < rate < float("inf"):
        raise ValueError(f"link rate {mbit!r} must be a finite number of Mbit/s above 0 "
                         "(e.g. 100 or 20); leave it out for an unshaped link")
    return rate


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


__all__ = ["DECOY_IFACE", "TAILNET_IFACE", "NamespaceAgent", "NetnsCluster", "Node",
           "check_rate", "netns_unavailable_reason"]
