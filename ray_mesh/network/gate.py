"""Short-lived TCP listeners that serve only this run's peers, a bounded number at a time.

ray_mesh opens plain TCP listeners of its own on the nodes' chosen addresses: the
pre-flight's (``ray_mesh.network.probe``) and the link bandwidth probe's
(``ray_mesh.network.links``). Anyone who can reach the address could connect to them, so
both go through :class:`GatedListener`:

* **a per-run nonce**: the orchestrator makes one secret (:func:`new_nonce`) and hands it to
  the listeners and the clients through Ray's own (token-authenticated) calls. A client must
  send it as its first line (:func:`send_nonce`); any other client is closed without an
  answer, after at most :data:`NONCE_TIMEOUT_S`;
* **a cap on connections**: at most ``max_clients`` connections are served at once, each on
  its own thread, so threads are bounded (300 connections do not make 300 threads). The
  accept loop takes a free slot *before* it accepts, so connections beyond the cap wait in
  the kernel's backlog instead of being dropped: a real peer stuck behind a burst is served
  late, not failed;
* **a lifetime**: the listener closes at ``lifetime_s`` even if nobody stops it, so an
  orchestrator that dies leaves nothing listening.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from collections.abc import Callable

NONCE_TIMEOUT_S = 2.0
"""How long a connected client has to send the nonce line before it is closed."""
BACKLOG = 64


def new_nonce() -> str:
    """A per-run secret (128 bits, hex): only the orchestrator's clients are answered."""
    return secrets.token_hex(16)


def send_nonce(sock: socket.socket, nonce: str) -> None:
    """The client side of the gate: the nonce as the connection's first line."""
    sock.sendall(nonce.encode() + b"\n")


def read_line(conn: socket.socket, limit: int) -> bytes:
    """One ``\\n``-terminated line (without it), at most ``limit`` bytes read."""
    buf = b""
    while not buf.endswith(b"\n") and len(buf) <= limit:
        data = conn.recv(1)
        if not data:
            break
        buf += data
    return buf.rstrip(b"\n")


class GatedListener:
    """Listens on ``address:port`` and calls ``handler(conn)`` for clients with the nonce.

    Args:
        address: the address to bind (the node's chosen address, never all interfaces).
        port: 0 for any free port; :attr:`port` is the one bound.
        nonce: the run's secret (:func:`new_nonce`); must not be empty.
        handler: serves one accepted, authenticated connection; the gate closes it after.
        lifetime_s: the listener stops accepting and closes after this many seconds.
        max_clients: connections served at once (threads alive at once, besides the
            accept thread).
        reuse_address: SO_REUSEADDR, for a port another server binds right after (the
            rendezvous port is torch's TCPStore's once the pre-flight is done).
        name: the accept thread's name.

    Raises:
        OSError: the address:port cannot be bound (the caller reports it).
        ValueError: an empty nonce or a cap below 1.
    """

    def __init__(self, address: str, port: int, nonce: str,
                 handler: Callable[[socket.socket], None], *, lifetime_s: float,
                 max_clients: int, reuse_address: bool = True,
                 name: str = "ray_mesh-listener") -> None:
        if not nonce:
            raise ValueError("GatedListener needs the run's nonce (new_nonce()), not ''")
        if max_clients < 1:
            raise ValueError(f"max_clients={max_clients!r}: serve at least one client")
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        if reuse_address:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((address, port))
            self.sock.listen(BACKLOG)
        except OSError:
            self.sock.close()
            raise
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.nonce = nonce.encode()
        self.handler = handler
        self.deadline = time.monotonic() + lifetime_s
        self.max_clients = max_clients
        self._slots = threading.BoundedSemaphore(max_clients)
        self.stopped = threading.Event()
        self.served = 0  # connections that sent the nonce (tests, diagnostics)
        self.refused = 0  # connections closed for a wrong or missing nonce
        self._count_lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, daemon=True,
                                       name=f"{name}-{self.port}")
        self.thread.start()

    def _running(self) -> bool:
        return not self.stopped.is_set() and time.monotonic() < self.deadline

    def _serve(self) -> None:
        try:
            while self._running():
                # A slot first, then accept: over the cap, clients wait in the backlog.
                if not self._slots.acquire(timeout=0.2):
                    continue
                try:
                    conn, _ = self.sock.accept()
                except (TimeoutError, OSError):
                    self._slots.release()
                    continue
                threading.Thread(target=self._client, args=(conn,), daemon=True,
                                 name=f"{self.thread.name}-client").start()
        finally:
            self.sock.close()

    def _client(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(max(0.1, min(NONCE_TIMEOUT_S, self.deadline - time.monotonic())))
                try:
                    head = read_line(conn, len(self.nonce) + 1)
                except OSError:
                    head = b""
                ok = hmac.compare_digest(head, self.nonce)
                with self._count_lock:
                    if ok:
                        self.served += 1
                    else:
                        self.refused += 1
                if not ok:
                    return  # not one of this run's clients: closed without a word
                self.handler(conn)
        except OSError:
            pass
        finally:
            self._slots.release()

    def stop(self) -> None:
        """Stop accepting (within ~0.2 s); served connections finish on their own."""
        self.stopped.set()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop and wait (bounded) until the listening socket is closed."""
        self.stop()
        self.thread.join(timeout=timeout_s)


__all__ = ["BACKLOG", "NONCE_TIMEOUT_S", "GatedListener", "new_nonce", "read_line",
           "send_nonce"]
