"""Path MTU between nodes, measured with don't-fragment UDP probes (Ray-free).

Why: a tunnel whose underlay cannot carry full-size packets is an *MTU blackhole*. Over
Tailscale ``tailscale0`` has MTU 1280, so a 1280-byte packet leaves as ~1340 bytes of
WireGuard-in-UDP; a hop on the way with a smaller MTU that drops instead of answering
"fragmentation needed" lets pings, handshakes and the pre-flight's small connects through,
while a collective's first full-size segment vanishes and NCCL or gloo waits for its
timeout. Only a probe of the full size finds that.

How: each node runs an :class:`EchoServer` (UDP, on its chosen address, answering only the
nodes' addresses and the per-run nonce, with a few bytes: no amplification). Each node
sends datagrams with the don't-fragment bit set (``IP_PMTUDISC_DO``) to every other node,
first of the interface's MTU, then a binary search down to :data:`FLOOR`; the largest size
that gets an answer is the path MTU of that direction. Each probe waits at most
``probe_s`` (twice), so a pair costs at most ~2 * 10 * 2 * probe_s.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import psutil

from ray_mesh.network.gate import new_nonce, peer_key

# Linux socket options (not all of them are in Python's socket module).
IP_MTU_DISCOVER, IP_PMTUDISC_DO = 10, 2
IPV6_MTU_DISCOVER, IPV6_PMTUDISC_DO = 23, 2
HEADERS = {socket.AF_INET: 28, socket.AF_INET6: 48}  # IP + UDP headers
MAX_PACKET = 65535  # an IPv4 packet's largest total length
FLOOR = 576  # the smallest probe; IPv4's minimum reassembly size
DEFAULT_PROBE_S = 0.3
TRIES = 2


@dataclass(frozen=True)
class PathMtu:
    """What ``a`` can send to ``b`` in one packet: ``mtu`` (0: not even :data:`FLOOR`
    bytes got an answer) against the MTU of ``a``'s interface (``interface_mtu``)."""

    a: str
    b: str
    mtu: int
    interface_mtu: int
    interface: str = ""

    @property
    def blackhole(self) -> bool:
        return 0 < self.mtu < self.interface_mtu


class EchoServer:
    """Answers ``ok SEQ SIZE`` to each probe from ``peers`` that starts with ``nonce``;
    closes itself after ``lifetime_s``."""

    def __init__(self, address: str, nonce: str, lifetime_s: float = 60.0,
                 peers: Sequence[str] | None = None) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind((address, 0))
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.nonce = nonce.encode()
        self.peers = None if peers is None else {peer_key(p) for p in [*peers, address]}
        self.deadline = time.monotonic() + lifetime_s
        self.closed = threading.Event()
        threading.Thread(target=self._serve, name="ray_mesh-mtu-echo", daemon=True).start()

    def _serve(self) -> None:
        while not self.closed.is_set() and time.monotonic() < self.deadline:
            try:
                data, src = self.sock.recvfrom(65535)
            except (TimeoutError, OSError):
                continue
            if self.peers is not None and peer_key(src[0]) not in self.peers:
                continue
            if not data.startswith(self.nonce + b" "):
                continue
            seq = data[len(self.nonce) + 1:].split(b" ", 1)[0][:16]
            with contextlib.suppress(OSError):
                self.sock.sendto(b"ok " + seq + b" %d" % len(data), src)
        self.sock.close()

    def close(self) -> None:
        self.closed.set()


def interface_of(address: str) -> tuple[str, int]:
    """The name and MTU of the local interface holding ``address`` (or, failing that, the
    subnet it lies in, as 127.0.0.2 in lo's 127.0.0.0/8); ("", 1500) if none."""
    stats = psutil.net_if_stats()
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    inside = ""
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or name not in stats:
                continue
            if a.address.split("%", 1)[0] == str(ip):
                return name, int(stats[name].mtu)
            with contextlib.suppress(ValueError, TypeError):
                net = ipaddress.ip_network(f"{a.address.split('%', 1)[0]}/{a.netmask}",
                                          strict=False)
                if ip in net and not inside:
                    inside = name
    return (inside, int(stats[inside].mtu)) if inside else ("", 1500)


class _Prober:
    def __init__(self, src: str, dst: str, port: int, nonce: str, probe_s: float) -> None:
        self.family = socket.AF_INET6 if ":" in dst else socket.AF_INET
        self.sock = socket.socket(self.family, socket.SOCK_DGRAM)
        if self.family == socket.AF_INET:
            self.sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        else:
            self.sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, IPV6_PMTUDISC_DO)
        self.sock.bind((src, 0))
        self.sock.connect((dst, port))
        self.nonce, self.probe_s, self.seq = nonce.encode(), probe_s, 0

    def fits(self, size: int) -> bool:
        """Did a ``size``-byte packet (headers included) arrive? (bounded)"""
        body = size - HEADERS[self.family]
        for _ in range(TRIES):
            self.seq += 1
            head = self.nonce + b" %d " % self.seq
            try:
                self.sock.send(head + b"\0" * max(0, body - len(head)))
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE:  # larger than the route's known MTU
                    return False
                raise
            want = b"ok %d %d" % (self.seq, max(body, len(head)))
            end = time.monotonic() + self.probe_s
            while (left := end - time.monotonic()) > 0:
                self.sock.settimeout(left)
                try:
                    if self.sock.recv(64) == want:
                        return True
                except (TimeoutError, ConnectionRefusedError):
                    break
        return False


def probe_paths(src: str, targets: Sequence[tuple[str, int]], nonce: str,
                probe_s: float = DEFAULT_PROBE_S) -> list[dict[str, object]]:
    """From this node (address ``src``): the path MTU to each ``(address, echo port)``."""
    iface, iface_mtu = interface_of(src)
    iface_mtu = min(iface_mtu, MAX_PACKET)  # loopback's 65536 is more than one IP packet

    def one(target: tuple[str, int]) -> dict[str, object]:
        dst, port = target
        try:
            prober = _Prober(src, dst, port, nonce, probe_s)
        except OSError:
            return asdict(PathMtu(src, dst, 0, iface_mtu, iface))
        with prober.sock:
            if prober.fits(iface_mtu):
                return asdict(PathMtu(src, dst, iface_mtu, iface_mtu, iface))
            if not prober.fits(FLOOR):
                return asdict(PathMtu(src, dst, 0, iface_mtu, iface))
            lo, hi = FLOOR, iface_mtu  # lo arrives, hi does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if prober.fits(mid) else (lo, mid)
            return asdict(PathMtu(src, dst, lo, iface_mtu, iface))

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(targets)))) as pool:
        return list(pool.map(one, targets))


@dataclass
class MtuReport:
    """Every ordered pair's path MTU."""

    paths: list[PathMtu]

    def blackholes(self) -> list[PathMtu]:
        return [p for p in self.paths if p.blackhole]

    def problems(self) -> list[str]:
        """One line per blackholed direction: what happens and the fix."""
        lines = []
        for p in self.blackholes():
            iface = p.interface or "the interface"
            hdr = HEADERS[socket.AF_INET6 if ":" in p.b else socket.AF_INET]
            lines.append(
                f"MTU blackhole {p.a} -> {p.b}: packets over {p.mtu} bytes are dropped "
                f"without an error, but {iface} on {p.a} sends up to {p.interface_mtu}: "
                f"small messages pass, full-size packets of a collective vanish and it "
                f"hangs until its timeout. Check from {p.a}: `ping -M do -s "
                f"{p.interface_mtu - hdr} {p.b}` (no answer) against `ping -M do -s "
                f"{p.mtu - hdr} {p.b}`. Fix the underlay between the two (a hop with a "
                f"smaller MTU that drops instead of answering 'fragmentation needed'), or "
                f"lower the MTU to {p.mtu} on every node: `sudo ip link set {iface} mtu "
                f"{p.mtu}`.")
        return lines

    def format(self) -> str:
        if not self.paths:
            return "path MTU: one node, nothing to measure"
        lines = ["Path MTU, bytes (largest packet that arrived, don't-fragment set):"]
        lines += [f"  {p.a} -> {p.b}: " + (f"{p.mtu}" if p.mtu else
                                           f"no answer to {FLOOR}-byte UDP probes")
                  + (f" (interface {p.interface} MTU {p.interface_mtu})" if p.blackhole else "")
                  for p in self.paths]
        return "\n".join([*lines, *self.problems()])

    def to_json(self) -> list[dict[str, object]]:
        return [{**asdict(p), "blackhole": p.blackhole} for p in self.paths]


# Node-side entry points (the orchestrator calls these on one process per node).
_SERVERS: dict[int, EchoServer] = {}


def start_echo(address: str, nonce: str, lifetime_s: float = 60.0,
               peers: Sequence[str] | None = None) -> int:
    server = EchoServer(address, nonce, lifetime_s, peers)
    _SERVERS[server.port] = server
    return server.port


def stop_echo(port: int) -> None:
    server = _SERVERS.pop(port, None)
    if server is not None:
        server.close()


def measure_path_mtu(addresses: Sequence[str], run_on: Callable[..., object], *,
                     probe_s: float = DEFAULT_PROBE_S) -> MtuReport:
    """Every ordered pair's path MTU through ``run_on(i, fn, *args)`` (as in
    :func:`ray_mesh.network.links.measure_links`); all nodes probe at the same time."""
    if not 0 < probe_s <= 5:
        raise ValueError(f"probe_s={probe_s!r}: give seconds per probe in (0, 5]")
    n = len(addresses)
    if n < 2:
        return MtuReport([])
    nonce = new_nonce()
    lifetime = 60.0 + 40 * TRIES * probe_s
    ports = [int(run_on(i, start_echo, addresses[i], nonce, lifetime, list(addresses)))
             for i in range(n)]
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = [pool.submit(run_on, i, probe_paths, addresses[i],
                                   [(addresses[j], ports[j]) for j in range(n) if j != i],
                                   nonce, probe_s) for i in range(n)]
            rows = [row for fut in futures for row in fut.result()]
    finally:
        for i in range(n):
            with contextlib.suppress(Exception):
                run_on(i, stop_echo, ports[i])
    return MtuReport([PathMtu(str(r["a"]), str(r["b"]), int(r["mtu"]), int(r["interface_mtu"]),
                              str(r["interface"])) for r in rows])
