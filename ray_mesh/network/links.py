"""Link bandwidth between nodes, measured by a short, bounded TCP transfer (Ray-free).

Over a VPN the link between nodes decides which mesh layout is fastest (see
``ray_mesh.planning.cost``), so ray_mesh measures it instead of guessing:

* one process per node runs a :class:`BandwidthServer` on the node's *chosen* address (the
  interface the collectives will use), which counts what it receives and answers the
  sender with ``bytes, seconds`` measured at the receiver: the sender's own count would
  include what still sits in socket buffers, several MB, which at 20 Mbit/s is seconds;
* nodes send to each other in rounds of disjoint pairs (:func:`pair_rounds`): two
  transfers that share a node at the same time would split its link and each read half.
  Up to :data:`~ray_mesh.network.pairs.FULL_MESH_NODES` nodes that is every pair, n-1
  rounds; past it, :data:`SAMPLED_ROUNDS` of those rounds drawn per run
  (:func:`link_rounds`), each node against that many other nodes: a time and a byte count
  that do not grow with n per node (9 s at the default bound, at 512 nodes as at 17),
  where every pair would take n-1 rounds (over 8 minutes at 512). What that keeps: the
  slowest link of a node whose own links are slow (every link it has is), so such a node
  is still named; the slowest link of all is the slowest link sampled. What it gives up:
  one slow pair between two fast nodes (a relayed path) is seen only in a run that draws
  it; each run draws other rounds;
* a last round has every node send to its own address: the within-node figure (a = b).
  It is kernel TCP, not NVLink or PCIe: a floor for the intra-node path, not its speed.

Each transfer is bounded by bytes and by seconds, so a measurement costs at most
``rounds * max_s`` (2 s for two nodes at the default 1 s) and a fast link finishes early
(32 MB at 10 Gbit/s: ~30 ms). One direction is measured per pair (the lower node index
sends): VPN links are symmetric enough for planning.

Connections must come from one of the nodes' addresses and open with the per-run nonce
the orchestrator hands out; any other client is dropped, and the server takes at most
:data:`MAX_CLIENTS` at once, each for a bounded time (``ray_mesh.network.gate``).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import random
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from ray_mesh.errors import LinkError
from ray_mesh.network.gate import GatedListener, new_nonce, read_line, send_nonce
from ray_mesh.network.pairs import FULL_MESH_NODES

CHUNK = 64 * 1024
DEFAULT_MAX_S = 1.0
DEFAULT_MAX_BYTES = 32 * 1024 * 1024
MAX_CLIENTS = 4
# Sender-side socket buffer: small, so that little is left to drain after the last write.
SNDBUF = 256 * 1024
SLOW_FACTOR = 0.5  # a node whose links run below half the others' median is named slow
EXPORT_ALL_NODES = 16
"""Up to this many nodes rank 0 exports every link as a metric; past it, a bounded set
(:meth:`LinkMatrix.exported`)."""
# A link below a quarter of the other links' median is probably relayed: Tailscale falls
# back to its DERP relays (a few to tens of Mbit/s) when two nodes cannot connect directly.
RELAY_FACTOR = 0.25
RELAY_HINTS_SHOWN = 5  # the slowest relayed links a table names, then a count
SAMPLED_ROUNDS = 8
"""Past FULL_MESH_NODES nodes: rounds of disjoint pairs measured, each node against this
many other nodes (one fewer for an odd node count's sitting-out node)."""


@dataclass(frozen=True)
class Link:
    """Measured throughput from node address ``a`` to ``b`` (a == b: within one node)."""

    a: str
    b: str
    mbit_s: float


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every unordered pair of ``n`` nodes once, in rounds where no node appears twice.

    The circle method of round-robin tournaments: n-1 rounds for even n, n for odd n
    (one node sits out each round). Pairs are ``(low, high)``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"pair_rounds needs a node count >= 1, got {n!r}")
    ids: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(ids)
    rounds = []
    for _ in range(m - 1):
        pairs = []
        for k in range(m // 2):
            x, y = ids[k], ids[m - 1 - k]
            if x is not None and y is not None:
                pairs.append((min(x, y), max(x, y)))
        if pairs:
            rounds.append(sorted(pairs))
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds


def link_rounds(n: int, *, seed: int | None = None, full_mesh_nodes: int = FULL_MESH_NODES,
                sampled: int = SAMPLED_ROUNDS) -> list[list[tuple[int, int]]]:
    """The rounds of node pairs a link measurement runs: every pair (:func:`pair_rounds`) up
    to ``full_mesh_nodes`` nodes, else ``sampled`` of those rounds drawn at random (``seed``:
    the same draw), so that each node is measured against ``sampled`` distinct others (one
    fewer, at most, for odd ``n``) in ``sampled`` rounds whatever ``n``."""
    rounds = pair_rounds(n) if n > 1 else []
    if n <= full_mesh_nodes or len(rounds) <= sampled:
        return rounds
    picked = random.Random(seed).sample(range(len(rounds)), sampled)
    return [rounds[k] for k in sorted(picked)]


def _median_without(ordered: Sequence[float], skip: Sequence[float]) -> float:
    """The median of ``ordered`` (sorted) without one occurrence of each value of ``skip``
    (sorted, a sub-multiset of it), in O(len(skip) * log n): the median of "the other
    links" for each node or link of a large matrix, where a new list per node would make
    the whole judgement O(n * links)."""
    m = len(ordered) - len(skip)
    if m <= 0:
        raise ValueError("no value left for a median")
    # Positions of the skipped values in ordered: the leftmost unused occurrence of each.
    removed: list[int] = []
    for value in skip:
        i = bisect.bisect_left(ordered, value)
        while removed and i <= removed[-1] and ordered[removed[-1]] == value:
            i = removed[-1] + 1
        removed.append(i)

    def kth(k: int) -> float:  # the k-th (0-based) of what is left
        pos = k
        for r in removed:  # sorted, few: each removed position at or before pos shifts it
            if r <= pos:
                pos += 1
        return ordered[pos]

    if m % 2:
        return kth(m // 2)
    return (kth(m // 2 - 1) + kth(m // 2)) / 2


class BandwidthServer:
    """Receives transfers on ``address`` and answers each sender with what arrived.

    Lives until :meth:`close` or ``lifetime_s``, whichever comes first, so an orchestrator
    that dies cannot leave a listener behind. Only senders from ``peers`` (None: any
    address) with ``nonce`` are served, at most :data:`MAX_CLIENTS` at once, each for at
    most ``session_s`` (``ray_mesh.network.gate``).
    """

    def __init__(self, address: str, nonce: str, lifetime_s: float = 30.0,
                 peers: Sequence[str] | None = None, session_s: float | None = None) -> None:
        self._listener = GatedListener(address, 0, nonce, self._receive,
                                       lifetime_s=lifetime_s, max_clients=MAX_CLIENTS,
                                       allowed_peers=peers, session_s=session_s,
                                       name="ray_mesh-bandwidth")
        self.port: int = self._listener.port

    def _receive(self, conn: socket.socket) -> None:
        conn.settimeout(max(1.0, self._listener.deadline - time.monotonic()))
        total, first, last = 0, 0.0, 0.0
        while True:
            data = conn.recv(CHUNK * 4)
            if not data:
                break
            now = time.perf_counter()
            if not first:
                first = now  # the first chunk starts the clock and is not counted
            else:
                total += len(data)
            last = now
        conn.sendall(f"{total} {max(last - first, 0.0):.9f}\n".encode())

    def close(self) -> None:
        self._listener.close()


def send_to(src: str, dst: str, port: int, nonce: str, max_s: float = DEFAULT_MAX_S,
            max_bytes: int = DEFAULT_MAX_BYTES) -> float:
    """Send from ``src`` to a :class:`BandwidthServer` at ``dst:port``; Mbit/s received.

    Stops after ``max_bytes`` or ``max_s`` seconds of sending, whichever comes first; the
    answer waits for the receiver at most ``max_s + 5`` more seconds.
    """
    family = socket.AF_INET6 if ":" in dst else socket.AF_INET
    payload = b"\0" * CHUNK
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
            sock.settimeout(max_s + 5.0)
            sock.bind((src, 0))
            sock.connect((dst, port))
            send_nonce(sock, nonce)
            sent, end = 0, time.monotonic() + max_s
            while sent < max_bytes and time.monotonic() < end:
                sock.sendall(payload)
                sent += CHUNK
            sock.shutdown(socket.SHUT_WR)
            answer = read_line(sock, 64, deadline=time.monotonic() + max_s + 5.0).decode()
    except OSError as exc:
        raise LinkError(f"bandwidth probe {src} -> {dst}:{port} failed: {exc}; check that "
                        f"{dst} is reachable from {src} over the chosen interface "
                        "(`ray-mesh doctor`)") from exc
    try:
        received, seconds = answer.split()
        received_b, seconds_f = int(received), float(seconds)
    except ValueError:
        raise LinkError(f"bandwidth probe {src} -> {dst}:{port}: the receiver gave no count "
                        f"({answer!r}); was it started with the same nonce?") from None
    if seconds_f <= 0 or received_b <= 0:
        raise LinkError(f"bandwidth probe {src} -> {dst}: too little data arrived to measure "
                        f"({received_b} bytes in {seconds_f:.3f} s); raise max_s")
    return received_b * 8 / seconds_f / 1e6


@dataclass
class LinkMatrix:
    """Measured links, one per node pair plus one per node (a == b)."""

    links: list[Link]
    error: str = ""  # why the measurement stopped early (a pair failed), if it did

    def to_json(self) -> list[dict[str, object]]:
        return [asdict(link) for link in self.links]

    @classmethod
    def from_json(cls, data: Sequence[dict[str, object]]) -> LinkMatrix:
        return cls([Link(str(d["a"]), str(d["b"]), float(d["mbit_s"])) for d in data])

    def nodes(self) -> list[str]:
        return sorted({x for link in self.links for x in (link.a, link.b)})

    def cross(self) -> list[Link]:
        return [link for link in self.links if link.a != link.b]

    def exported(self, all_up_to: int = EXPORT_ALL_NODES) -> LinkMatrix:
        """The links rank 0 exports as the ``ray_mesh_link_mbit`` gauge, for ``ray-mesh
        status``: all of them up to ``all_up_to`` nodes; past that, per node its within-node
        link and its slowest and fastest link to another node, at most 3 per node.

        Every link would be n(n+1)/2 series, 131,328 at 512 nodes: more than a node's page
        may hold (``ray-mesh status`` reads 8 MiB of it), in every Prometheus that scrapes
        it. The set kept still holds what status judges by: the slowest link of all, and
        each node's fastest, so a node all of whose links are slow (:meth:`slow_nodes`) is
        still one whose fastest is slow; the median of the others is then taken over the
        others' slowest and fastest links, not all of them."""
        nodes = self.nodes()
        if len(nodes) <= all_up_to:
            return LinkMatrix(list(self.links), self.error)
        keep: dict[tuple[str, str], Link] = {}
        for link in self.links:
            if link.a == link.b:
                keep[(link.a, link.b)] = link
        mine: dict[str, list[Link]] = {}
        for link in self.cross():
            mine.setdefault(link.a, []).append(link)
            mine.setdefault(link.b, []).append(link)
        for links in mine.values():
            for link in (min(links, key=lambda x: x.mbit_s), max(links, key=lambda x: x.mbit_s)):
                keep[(link.a, link.b)] = link
        return LinkMatrix(list(keep.values()), self.error)

    def cross_node_mbit(self) -> float:
        """The slowest link between two nodes (what a collective across nodes waits for)."""
        cross = self.cross()
        return min(link.mbit_s for link in cross) if cross else math.inf

    def _by_node(self) -> tuple[list[float], dict[str, list[float]]]:
        """All cross-node rates, sorted, and each node's, sorted."""
        cross = self.cross()
        mine: dict[str, list[float]] = {node: [] for node in self.nodes()}
        for link in cross:
            mine[link.a].append(link.mbit_s)
            mine[link.b].append(link.mbit_s)
        return sorted(x.mbit_s for x in cross), {k: sorted(v) for k, v in mine.items()}

    def _others_median(self, ordered: list[float], mine: list[float]) -> float | None:
        """The median of the cross-node links that do not touch a node (``mine``: its own)."""
        return _median_without(ordered, mine) if len(ordered) > len(mine) else None

    def _slow(self) -> list[tuple[str, float, float]]:
        """``(node, its fastest cross-node link, the others' median)`` for each node all of
        whose cross-node links run below SLOW_FACTOR x the median of the links not its own."""
        ordered, by_node = self._by_node()
        slow = []
        for node, mine in by_node.items():
            others = self._others_median(ordered, mine)
            if mine and others is not None and mine[-1] < SLOW_FACTOR * others:
                slow.append((node, mine[-1], others))
        return slow

    def slow_nodes(self) -> list[str]:
        """Nodes all of whose cross-node links run below SLOW_FACTOR x the others' median."""
        return [node for node, _, _ in self._slow()]

    def relayed(self) -> list[tuple[Link, float]]:
        """Links far slower than the rest (below RELAY_FACTOR x the median of the other
        cross-node links), with that median; needs 3+ links to compare."""
        cross = self.cross()
        if len(cross) < 3:
            return []
        ordered = sorted(x.mbit_s for x in cross)
        out = []
        for link in cross:
            others = _median_without(ordered, [link.mbit_s])
            if link.mbit_s < RELAY_FACTOR * others:
                out.append((link, others))
        return out

    def relay_hints(self, most: int | None = RELAY_HINTS_SHOWN) -> list[str]:
        """For the ``most`` slowest :meth:`relayed` links (None: all): the pair, the numbers
        and the commands to check; then how many more there are (a console of hundreds of
        hints reads as none)."""
        relayed = sorted(self.relayed(), key=lambda x: x[0].mbit_s)
        most = len(relayed) if most is None else most
        hints = [f"link {x.a} <-> {x.b}: {x.mbit_s:.1f} Mbit/s, {med / x.mbit_s:.0f}x slower "
                 f"than the other links ({med:.0f} Mbit/s): probably relayed (Tailscale DERP) "
                 f"instead of direct. Check on {x.a}: `tailscale ping {x.b}` ('via DERP(...)' "
                 f"is relayed, 'via IP:port' direct) and `tailscale status` (the peer's line "
                 f"says relay or direct); a direct path usually needs UDP 41641 open on both "
                 f"nodes' firewalls, or a NAT that is not symmetric."
                 for x, med in relayed[:most]]
        if len(relayed) > most:
            hints.append(f"... and {len(relayed) - most} more link(s) below {RELAY_FACTOR:g}x "
                         "the others' median (`ray-mesh doctor --json` lists every link)")
        return hints

    def verdict(self) -> str:
        """One line a person reads: the slow node and its rate, or the slowest link."""
        cross = self.cross()
        if not cross:
            return "one node: no link between nodes"
        if slow := self._slow():
            return "; ".join(f"node {node}: links at most {mine:.0f} Mbit/s, "
                             f"{others / mine:.1f}x slower than the other links "
                             f"({others:.0f} Mbit/s)" for node, mine, others in slow)
        worst = min(cross, key=lambda x: x.mbit_s)
        return f"slowest link {worst.a} <-> {worst.b}: {worst.mbit_s:.0f} Mbit/s"

    def caption(self, full_up_to: int = FULL_MESH_NODES) -> str:
        """What :meth:`format`'s table shows, for the line above it."""
        if len(self.nodes()) <= full_up_to:
            return "Mbit/s, row sends to column; the diagonal is within a node"
        return ("Mbit/s, a line per node: the links measured from and to it, their slowest, "
                "median and fastest, and within the node")

    def format(self, full_up_to: int = FULL_MESH_NODES) -> str:
        """A node x node table of Mbit/s (row sends to column; the diagonal is within-node)
        up to ``full_up_to`` nodes; past that, a line per node (its links measured, their
        slowest, median and fastest, its within-node figure), since a 512 x 512 table is
        not one a person reads, and most of its cells would be unmeasured."""
        nodes = self.nodes()
        rate = {(x.a, x.b): x.mbit_s for x in self.links}
        rows = []
        if len(nodes) <= full_up_to:
            for a in nodes:
                cells = []
                for b in nodes:
                    v = rate.get((a, b), rate.get((b, a)))
                    cells.append("-" if v is None else f"{v:.0f}")
                rows.append([a, *cells])
            header = ["Mbit/s", *nodes]
        else:
            _, by_node = self._by_node()
            for a in nodes:
                mine = by_node[a]
                within = rate.get((a, a))
                figures = ([f"{mine[0]:.0f}", f"{statistics.median(mine):.0f}",
                            f"{mine[-1]:.0f}"] if mine else ["-", "-", "-"])
                rows.append([a, str(len(mine)), *figures,
                             "-" if within is None else f"{within:.0f}"])
            header = ["Mbit/s", "links", "slowest", "median", "fastest", "within"]
        widths = [max(len(str(r[k])) for r in [header, *rows]) for k in range(len(header))]
        lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True))
                 for r in [header, *rows]]
        tail = [f"bandwidth measurement stopped: {self.error}"] if self.error else []
        return "\n".join([*lines, self.verdict(), *self.relay_hints(), *tail])

    def dumps(self) -> str:
        return json.dumps({"links": self.to_json()})


# Node-side entry points: the orchestrator calls these on one process per node (a Ray
# worker or node agent, or a test's namespace agent); the server outlives the call.
_SERVERS: dict[int, BandwidthServer] = {}


def start_server(address: str, nonce: str, lifetime_s: float = 30.0,
                 peers: Sequence[str] | None = None, session_s: float | None = None) -> int:
    """Start a :class:`BandwidthServer` in this process; returns its port."""
    server = BandwidthServer(address, nonce, lifetime_s, peers, session_s)
    _SERVERS[server.port] = server
    return server.port


def stop_server(port: int) -> None:
    server = _SERVERS.pop(port, None)
    if server is not None:
        server.close()


RunOn = Callable[..., object]  # run_on(node_index, fn, *args) -> fn(*args) on that node


def measure_links(addresses: Sequence[str], run_on: RunOn, *, max_s: float = DEFAULT_MAX_S,
                  max_bytes: int = DEFAULT_MAX_BYTES, within_node: bool = True,
                  full_mesh_nodes: int = FULL_MESH_NODES) -> LinkMatrix:
    """Measure the node pairs of :func:`link_rounds` (every pair up to
    :data:`~ray_mesh.network.pairs.FULL_MESH_NODES` nodes) and each node to itself, through
    ``run_on``. ``full_mesh_nodes``: up to how many nodes every pair is measured.

    ``addresses[i]`` is node i's chosen address; ``run_on(i, fn, *args)`` runs ``fn`` in a
    process on node i and returns its value (raising on failure). Pairs run in rounds of
    disjoint pairs (:func:`pair_rounds`), the transfers of a round at the same time.
    """
    if not addresses:
        raise ValueError("measure_links needs at least one node address")
    if not 0 < max_s <= 30:
        raise ValueError(f"max_s={max_s!r}: give a bound of seconds per transfer in (0, 30]")
    nonce = new_nonce()
    n = len(addresses)
    rounds = link_rounds(n, full_mesh_nodes=full_mesh_nodes)
    lifetime = (len(rounds) + 2) * (max_s + 10.0)
    if within_node:
        rounds.append([(i, i) for i in range(n)])
    links: list[Link] = []
    ports: dict[int, int] = {}
    # The nodes' listeners start and stop at once, not one call after another: each call
    # is a round trip to a node (a Ray call over the tailnet), and 512 of them in a row
    # took longer than the 9 rounds of transfers.
    with ThreadPoolExecutor(max_workers=max(1, min(n, 256))) as pool:
        try:
            # Served: the nodes' own addresses only; a transfer and its answer within
            # max_s + 10 s.
            started = {i: pool.submit(run_on, i, start_server, addresses[i], nonce, lifetime,
                                      list(addresses), max_s + 10.0) for i in range(n)}
            for i, fut in started.items():
                with contextlib.suppress(Exception):
                    ports[i] = int(fut.result())
            for fut in started.values():
                fut.result()  # the first node whose listener did not start raises here
            for round_ in rounds:
                # Positional arguments only: run_on may be a plain (fn, args) transport.
                futures = {(i, j): pool.submit(run_on, i, send_to, addresses[i], addresses[j],
                                               ports[j], nonce, max_s, max_bytes)
                           for i, j in round_}
                for (i, j), fut in futures.items():
                    links.append(Link(addresses[i], addresses[j], float(fut.result())))
        finally:
            stops = [pool.submit(run_on, i, stop_server, port) for i, port in ports.items()]
            for fut in stops:
                with contextlib.suppress(Exception):
                    fut.result()
    return LinkMatrix(links)


def measure_locally(addresses: Sequence[str], **kw: float) -> LinkMatrix:
    """Measure between addresses of this host (tests, and a one-machine sanity check)."""
    return measure_links(addresses, lambda _i, fn, *args: fn(*args), **kw)
