"""Short-lived TCP listeners that serve only this run's peers, a bounded number at a time.

ray_mesh opens plain TCP listeners of its own on the nodes' chosen addresses: the
pre-flight's (``ray_mesh.network.probe``) and the link bandwidth probe's
(``ray_mesh.network.links``). Anyone who can reach the address could connect to them, so
both go through :class:`GatedListener`:

* **source addresses**: with ``allowed_peers`` (the run's nodes' chosen addresses; the
  listener's own address is always in), a connection from any other source is closed
  right after ``accept``, before it costs anything but that accept;
* **a per-run nonce**: the orchestrator makes one secret (:func:`new_nonce`) and hands it to
  the listeners and the clients through Ray's own (token-authenticated) calls. A client must
  send it as its first line (:func:`send_nonce`) within :data:`NONCE_TIMEOUT_S` of its
  accept, an absolute deadline for the whole line: a client trickling a byte at a time is
  closed on time like one that sends nothing;
* **no thread before the nonce**: the accept thread reads every nonce line itself, without
  blocking (a selector), so unauthenticated clients hold a file descriptor, never a serving
  slot. A crowd of slow clients therefore cannot delay a real peer, which sends its nonce
  at once and is served at once. At most ``max_pending`` of them are held; one more evicts
  the oldest, unless the oldest's nonce has arrived meanwhile (hundreds of real peers
  connecting at once, the rendezvous port of a large cluster's pre-flight, are read, not
  evicted);
* **a cap on connections**: at most ``max_clients`` authenticated connections are served at
  once, each on its own thread; more wait (already authenticated) for a free slot;
* **deadlines**: each served conversation is cut at ``session_s`` after it started, and the
  listener closes at ``lifetime_s`` even if nobody stops it, so an orchestrator that dies
  leaves nothing listening.

Every connection turned away is counted by kind (:class:`GateStats`), so a failing
pre-flight can say that strangers were knocking instead of blaming the link.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import ipaddress
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

NONCE_TIMEOUT_S = 2.0
"""How long a client has, from its accept, to send the whole nonce line (absolute)."""
BACKLOG = 64
"""Connections accepted per wake of the accept thread."""
LISTEN_BACKLOG = 1024
"""The kernel's queue of connections not yet accepted (capped by net.core.somaxconn): a
pre-flight's rendezvous port is asked by every node at once, one per node (past 64 nodes a
queue of 64 dropped the rest's SYNs, a second's retransmit each)."""
MAX_PENDING = 64
"""Connections that have not yet sent the nonce, held at once per listener (file
descriptors, not threads); one more evicts the oldest."""
_TICK_S = 0.2
_SHOWN_SOURCES = 5  # turned-away source addresses remembered for the report


def new_nonce() -> str:
    """A per-run secret (128 bits, hex): only the orchestrator's clients are answered."""
    return secrets.token_hex(16)


def send_nonce(sock: socket.socket, nonce: str) -> None:
    """The client side of the gate: the nonce as the connection's first line."""
    sock.sendall(nonce.encode() + b"\n")


def read_line(conn: socket.socket, limit: int, deadline: float | None = None) -> bytes:
    """One ``\\n``-terminated line (without it), at most ``limit`` bytes read.

    With ``deadline`` (a :func:`time.monotonic` value) the whole line must arrive by then:
    the socket timeout is recomputed from it before every read, so a peer that trickles a
    byte at a time cannot stretch the wait. Raises TimeoutError when it passes.
    """
    buf = b""
    while not buf.endswith(b"\n") and len(buf) <= limit:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete line by the deadline ({len(buf)} bytes)")
            conn.settimeout(left)
        try:
            data = conn.recv(1)
        except TimeoutError:
            if deadline is None:
                raise
            raise TimeoutError(f"no complete line by the deadline ({len(buf)} bytes)") \
                from None
        if not data:
            break
        buf += data
    return buf.rstrip(b"\n")


def peer_key(address: str) -> str:
    """An IP address in one canonical spelling, for comparing a connection's source.

    Drops an IPv6 scope (``%eth0``) and writes an IPv4-mapped IPv6 address as IPv4, so
    ``::ffff:10.0.0.1`` and ``10.0.0.1`` are the same peer. Raises ValueError on anything
    that is not an IP address (a hostname, say).
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        raise ValueError(f"allowed_peers needs IP addresses (each node's chosen address), "
                         f"got {address!r}") from None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


@dataclass
class GateStats:
    """What a listener did with its connections (all counts since it opened).

    ``served``: sent the nonce. Turned away: ``dropped`` (source address not allowed),
    ``refused`` (a wrong first line, or closed before one), ``expired`` (no whole nonce
    line within :data:`NONCE_TIMEOUT_S`), ``evicted`` (pushed out by newer connections
    while ``max_pending`` were waiting). ``sources``: a few of the turned-away addresses.
    """

    served: int = 0
    refused: int = 0
    expired: int = 0
    dropped: int = 0
    evicted: int = 0
    sources: list[str] = field(default_factory=list)

    @property
    def turned_away(self) -> int:
        return self.refused + self.expired + self.dropped + self.evicted

    def __add__(self, other: GateStats) -> GateStats:
        sources = list(dict.fromkeys(self.sources + other.sources))[:_SHOWN_SOURCES]
        return GateStats(self.served + other.served, self.refused + other.refused,
                         self.expired + other.expired, self.dropped + other.dropped,
                         self.evicted + other.evicted, sources)

    def describe(self) -> str:
        """One phrase: what was turned away and from where ('' when nothing was)."""
        parts = [f"{n} {what}" for n, what in (
            (self.dropped, "from addresses that are not the run's nodes"),
            (self.expired, f"that sent no nonce within {NONCE_TIMEOUT_S:.0f} s"),
            (self.refused, "with a wrong first line"),
            (self.evicted, "evicted by a flood of newer connections")) if n]
        if not parts:
            return ""
        src = f" (from {', '.join(self.sources)})" if self.sources else ""
        return f"turned away {self.turned_away} connection(s): {'; '.join(parts)}{src}"


class _Pending:
    """An accepted connection whose nonce line is still being read."""

    __slots__ = ("buf", "conn", "deadline", "source")

    def __init__(self, conn: socket.socket, source: str, deadline: float) -> None:
        self.conn, self.source, self.deadline, self.buf = conn, source, deadline, b""


def _abort(conn: socket.socket) -> None:
    """Close at once with a reset: no TIME_WAIT left on the listener's side."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


class GatedListener:
    """Listens on ``address:port`` and calls ``handler(conn)`` for clients with the nonce.

    Args:
        address: the address to bind (the node's chosen address, never all interfaces).
        port: 0 for any free port; :attr:`port` is the one bound.
        nonce: the run's secret (:func:`new_nonce`); must not be empty.
        handler: serves one accepted, authenticated connection; the gate closes it after.
        lifetime_s: the listener stops accepting and closes after this many seconds;
            conversations still going on then are cut.
        max_clients: connections served at once (threads alive at once, besides the
            accept thread).
        allowed_peers: the source addresses served (besides ``address`` itself, which a
            node's own probes come from); any other source is closed right after accept.
            None serves every source (the nonce still applies). :meth:`admit` changes it.
        session_s: a served conversation is cut this many seconds after it started
            (None: at the listener's lifetime).
        max_pending: connections held at once while their nonce line is read.
        reuse_address: SO_REUSEADDR, for a port another server binds right after (the
            rendezvous port is torch's TCPStore's once the pre-flight is done).
        name: the accept thread's name.

    Raises:
        OSError: the address:port cannot be bound (the caller reports it).
        ValueError: an empty nonce, a cap below 1, or an allowed peer that is not an IP.
    """

    def __init__(self, address: str, port: int, nonce: str,
                 handler: Callable[[socket.socket], None], *, lifetime_s: float,
                 max_clients: int, allowed_peers: Iterable[str] | None = None,
                 session_s: float | None = None, max_pending: int = MAX_PENDING,
                 reuse_address: bool = True, name: str = "ray_mesh-listener") -> None:
        if not nonce:
            raise ValueError("GatedListener needs the run's nonce (new_nonce()), not ''")
        if max_clients < 1 or max_pending < 1:
            raise ValueError(f"max_clients={max_clients!r}, max_pending={max_pending!r}: "
                             "serve at least one client")
        self.address = address
        self._allowed: frozenset[str] | None = None
        self.admit(allowed_peers)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if reuse_address:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((address, port))
            self.sock.listen(LISTEN_BACKLOG)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.nonce = nonce.encode()
        self.handler = handler
        self.deadline = time.monotonic() + lifetime_s
        self.session_s = session_s
        self.max_clients = max_clients
        self.max_pending = max_pending
        self.stopped = threading.Event()
        # Counters, written by the accept thread only (see GateStats for their meaning).
        self.served = self.refused = self.expired = self.dropped = self.evicted = 0
        self._sources: list[str] = []
        self._pending: collections.OrderedDict[socket.socket, _Pending] = \
            collections.OrderedDict()  # accept order = deadline order
        self._ready: collections.deque[socket.socket] = collections.deque()
        self._sessions: dict[socket.socket, float] = {}  # served now -> cut at
        self._lock = threading.Lock()  # guards _sessions (the reaper vs. the threads)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"{name}-{self.port}")
        self.thread.start()

    def admit(self, peers: Iterable[str] | None) -> None:
        """Serve connections from ``peers`` (and this listener's own address) from now on;
        None serves every source."""
        if isinstance(peers, str):
            raise ValueError(f"allowed_peers: give a collection of addresses, not the "
                             f"single string {peers!r}")
        self._allowed = None if peers is None else frozenset(
            peer_key(p) for p in [*peers, self.address])

    def stats(self) -> GateStats:
        return GateStats(self.served, self.refused, self.expired, self.dropped,
                         self.evicted, list(self._sources))

    def _running(self) -> bool:
        return not self.stopped.is_set() and time.monotonic() < self.deadline

    def _serve(self) -> None:
        try:
            while self._running():
                now = time.monotonic()
                first = next(iter(self._pending.values()), None)
                wait = _TICK_S if first is None else min(_TICK_S, first.deadline - now)
                for key, _ in self._sel.select(max(wait, 0.0)):
                    if key.data is None:
                        self._accept_some()
                    elif self._pending.get(key.data.conn) is key.data:  # not evicted since
                        self._read_nonce(key.data)
                now = time.monotonic()
                while self._pending and next(iter(self._pending.values())).deadline <= now:
                    self._turn_away(next(iter(self._pending.values())), "expired")
                self._start_sessions(now)
                self._cut_sessions(now)
        finally:
            self._close_all()

    def _note(self, kind: str, source: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if source not in self._sources and len(self._sources) < _SHOWN_SOURCES:
            self._sources.append(source)

    def _accept_some(self) -> None:
        for _ in range(BACKLOG):
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of file descriptors, say: make room, try next tick
                if self._pending:
                    self._turn_away(next(iter(self._pending.values())), "evicted")
                else:
                    time.sleep(0.05)  # nothing to free: do not spin on a ready socket
                return
            source = peer_key(addr[0])
            allowed = self._allowed
            if allowed is not None and source not in allowed:
                self._note("dropped", source)
                _abort(conn)  # before any read, slot or thread
                continue
            if len(self._pending) >= self.max_pending:
                oldest = next(iter(self._pending.values()))
                self._read_nonce(oldest)  # a real peer's nonce is likely there by now
                if self._pending.get(oldest.conn) is oldest:
                    self._turn_away(oldest, "evicted")
            conn.setblocking(False)
            pending = _Pending(conn, source, time.monotonic() + NONCE_TIMEOUT_S)
            self._pending[conn] = pending
            self._sel.register(conn, selectors.EVENT_READ, pending)

    def _read_nonce(self, p: _Pending) -> None:
        want = len(self.nonce) + 1 - len(p.buf)
        try:
            data = p.conn.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        p.buf += data
        if data and b"\n" not in p.buf and len(data) < want:
            return  # more to come (by the deadline)
        if not hmac.compare_digest(p.buf, self.nonce + b"\n"):
            self._turn_away(p, "refused")
            return
        self._unpend(p)
        self.served += 1
        self._ready.append(p.conn)

    def _unpend(self, p: _Pending) -> None:
        self._sel.unregister(p.conn)
        del self._pending[p.conn]

    def _turn_away(self, p: _Pending, kind: str) -> None:
        self._unpend(p)
        self._note(kind, p.source)
        if kind == "refused":  # a plain close, "no answer" (a reset if bytes were unread)
            with contextlib.suppress(OSError):
                p.conn.recv(4096)
            p.conn.close()
        else:
            _abort(p.conn)

    def _start_sessions(self, now: float) -> None:
        while self._ready and len(self._sessions) < self.max_clients:
            conn = self._ready.popleft()
            cut_at = self.deadline if self.session_s is None else now + self.session_s
            conn.setblocking(True)
            conn.settimeout(max(0.1, cut_at - now))
            with self._lock:
                self._sessions[conn] = cut_at
            threading.Thread(target=self._client, args=(conn,), daemon=True,
                             name=f"{self.thread.name}-client").start()

    def _cut_sessions(self, now: float, everything: bool = False) -> None:
        # Under the lock: a session's thread removes it (then closes it) under it too, so
        # the socket shut down here is still open.
        with self._lock:
            for conn, cut_at in self._sessions.items():
                if everything or cut_at <= now:
                    with contextlib.suppress(OSError):  # wakes the handler's recv/send
                        conn.shutdown(socket.SHUT_RDWR)

    def _client(self, conn: socket.socket) -> None:
        try:
            self.handler(conn)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sessions.pop(conn, None)
            conn.close()

    def _close_all(self) -> None:
        self._sel.close()
        self.sock.close()
        for p in list(self._pending.values()):
            self._note("expired", p.source)
            _abort(p.conn)
        self._pending.clear()
        for conn in self._ready:
            conn.close()
        self._ready.clear()
        self._cut_sessions(0.0, everything=True)

    def stop(self) -> None:
        """Stop accepting (within ~0.2 s); conversations still going on are cut."""
        self.stopped.set()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop and wait (bounded) until the listening socket is closed."""
        self.stop()
        self.thread.join(timeout=timeout_s)
