"""The pre-flight's worker side: listen, connect, report versions (plain Python, no Ray).

Runs in one process per node (a Ray Train worker, a ``ray-mesh doctor`` node agent, or a
test's namespace agent), called by the orchestration in ``ray_mesh.raytrain.preflight``:

1. :func:`open_listeners` chooses the node's interface (the same rule as the planner) and
   opens a short-lived TCP listener on the chosen address (rank 0's node also on the
   rendezvous port, MASTER_PORT), which proves the address is really on that node;
2. :func:`admit_peers` tells the listeners the other nodes' chosen addresses: until then
   they serve only the node's own address, and connections from any other source are
   closed right after accept;
3. :func:`probe_peers` connects from the chosen address to every other node's listener
   and to rank 0's rendezvous port, all at once, each within a short deadline;
4. :func:`close_listeners` stops them, so torch's TCPStore can bind the port at once, and
   says how many connections they turned away (strangers, clients without the nonce).

The listeners answer only connections that open with the run's nonce, which the
orchestrator passes to steps 1 and 3, and serve at most :data:`MAX_CLIENTS` at once with
as many threads (``ray_mesh.network.gate``, shared with the link bandwidth probe).

Nothing here raises on a network problem: every failure is data (:class:`NodeFacts`,
:class:`ConnectResult`) for the report in ``ray_mesh.network.report``.
"""

from __future__ import annotations

import errno
import platform
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata

from ray_mesh.network.gate import GatedListener, GateStats, send_nonce
from ray_mesh.network.interfaces import (
    Choice,
    NetworkError,
    choose_interface,
    host_port,
    local_interfaces,
)

GREETING = b"ray_mesh-preflight\n"
VERSION_KEYS = ("torch", "nccl", "ray", "python")
RENDEZVOUS = -1
"""The :attr:`Target.node` of rank 0's rendezvous port (MASTER_PORT), not a node's listener."""


def node_versions() -> dict[str, str]:
    """torch, NCCL (GPU builds), Ray and Python versions of this process's environment.

    The one version probe: the backend's worker probe and the pre-flight both use it, so
    the versions compared across nodes are read the same way everywhere.
    """
    out = {"python": platform.python_version()}
    for dist in ("torch", "ray"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    try:
        import torch

        out["torch"] = torch.__version__
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl or "")
    except Exception:  # noqa: BLE001 - a broken torch is reported as a version, not a crash
        out.setdefault("nccl", "")
    return out


@dataclass
class NodeFacts:
    """What step 1 found on node ``index``: its interfaces, choice, listener and versions.

    Exactly one of ``choice`` / ``choice_error`` is set; ``port`` is None when the listener
    could not bind (``bind_error`` says why). ``token`` names the listeners to close.
    """

    index: int
    node_ip: str
    hostname: str
    token: str
    interfaces: dict[str, list[str]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    choice: Choice | None = None
    choice_error: str = ""
    port: int | None = None
    bind_error: str = ""
    rendezvous_error: str = ""


@dataclass(frozen=True)
class Target:
    """Where step 2 connects: node ``node``'s listener, or :data:`RENDEZVOUS`."""

    node: int
    address: str
    port: int


@dataclass(frozen=True)
class ConnectResult:
    """One connect of step 2: ok, or the error as a person would describe it."""

    ok: bool
    error: str = ""
    ms: float = 0.0


MAX_CLIENTS = 16
"""Pre-flight connections served at once per listener (peers are served in milliseconds)."""
SESSION_S = 5.0
"""A served pre-flight conversation (greeting, then the client's close) is cut after this."""


def _greet(conn: socket.socket) -> None:
    # Send the greeting, then wait for the client to close first, so TIME_WAIT stays on
    # the client side and the rendezvous port is free to bind again at once.
    conn.settimeout(3.0)
    conn.sendall(GREETING)
    conn.recv(16)


def _listen(address: str, port: int, lifetime_s: float, nonce: str) -> GatedListener:
    """A pre-flight listener: answers only clients with this run's nonce (``gate``), from
    this node's own address until :func:`admit_peers` names the other nodes'."""
    return GatedListener(address, port, nonce, _greet, lifetime_s=lifetime_s,
                         max_clients=MAX_CLIENTS, allowed_peers=(), session_s=SESSION_S,
                         name="ray_mesh-preflight")


_listeners: dict[str, list[GatedListener]] = {}
_listeners_lock = threading.Lock()


def open_listeners(index: int, node_ip: str, interface: str, rendezvous_port: int | None,
                   lifetime_s: float, nonce: str) -> NodeFacts:
    """Step 1 on node ``index``: choose the interface, listen on its address, report facts.

    The listeners answer only clients that send ``nonce`` (the run's, from
    :func:`ray_mesh.network.gate.new_nonce`), at most :data:`MAX_CLIENTS` at once, and
    only from the chosen address itself until :func:`admit_peers`.
    Never raises: every problem is a field of the returned :class:`NodeFacts`.
    """
    facts = NodeFacts(index=index, node_ip=node_ip, hostname=socket.gethostname(),
                      token=uuid.uuid4().hex, interfaces=local_interfaces(),
                      versions=node_versions())
    try:
        choice = choose_interface(node_ip, interface, facts.interfaces)
    except NetworkError as exc:
        facts.choice_error = str(exc)
        return facts
    facts.choice = choice
    opened: list[GatedListener] = []
    try:
        main = _listen(choice.address, 0, lifetime_s, nonce)
        opened.append(main)
        facts.port = main.port
    except OSError as exc:
        facts.bind_error = f"cannot listen on {choice.address} ({choice.interface}): {exc}"
    if rendezvous_port:
        try:
            opened.append(_listen(choice.address, rendezvous_port, lifetime_s, nonce))
        except OSError as exc:
            facts.rendezvous_error = (f"cannot listen on the rendezvous port "
                                      f"{host_port(choice.address, rendezvous_port)}: {exc}")
    with _listeners_lock:
        _listeners[facts.token] = opened
    return facts


def admit_peers(token: str, addresses: Sequence[str]) -> bool:
    """Step 2: serve connections from ``addresses`` (the nodes' chosen addresses) too.

    Returns False when the listeners are gone (closed, or past their lifetime).
    """
    with _listeners_lock:
        opened = _listeners.get(token, [])
    for listener in opened:
        listener.admit(addresses)
    return bool(opened)


def close_listeners(token: str) -> GateStats:
    """Step 4: stop this node's listeners (they also stop on their own at their deadline);
    what they served and turned away, summed."""
    with _listeners_lock:
        opened = _listeners.pop(token, [])
    for listener in opened:
        listener.stop()
    stats = GateStats()
    for listener in opened:
        listener.thread.join(timeout=1.0)
        stats += listener.stats()
    return stats


CONNECT_TRIES = 3
"""Tries per probe when the listener closes without a greeting, all within its deadline."""


def _attempt(source: str, address: str, port: int, deadline: float,
             nonce: str) -> tuple[bool, str, bool]:
    """One connection: (ok, error, turned away) with connect, nonce and greeting all
    bounded by ``deadline``; "turned away": the listener closed it without a greeting."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    where = host_port(address, port)
    connected = False  # the handshake is done: a timeout from now on is not the link's
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            if source:
                s.bind((source, 0))  # leave from the chosen address, as NCCL will
            s.connect((address, port))
            connected = True
            send_nonce(s, nonce)
            data = b""
            while not data.endswith(b"\n") and len(data) < 64:
                s.settimeout(max(deadline - time.monotonic(), 0.01))
                chunk = s.recv(64)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        if connected:
            return False, (f"connected, but no greeting before the deadline: the listener "
                           f"on {where} is swamped or stalled (the TCP connection itself "
                           f"was made, so this is not a dropped link)"), False
        return False, ("timed out (packets dropped: link down, firewall, or the wrong "
                       "interface)"), False
    except ConnectionRefusedError:
        return False, "connection refused (a firewall rejects the port, or nothing listens)", \
            False
    except (ConnectionResetError, BrokenPipeError):
        # A reset, even one that beats connect()'s return, follows a completed handshake
        # (a firewall's reject is "refused"): the listener accepted, then turned it away.
        return False, _turned_away(where, source), True
    except OSError as exc:
        if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return False, f"no route to host ({exc.strerror})", False
        if exc.errno == errno.EADDRNOTAVAIL:
            return False, f"source address {source} is not on this node ({exc.strerror})", \
                False
        return False, f"{type(exc).__name__}: {exc}", False
    if data == GREETING:
        return True, "", False
    if not data:
        return False, _turned_away(where, source), True
    return False, f"something else answers on {where} (not the pre-flight listener)", False


def _turned_away(where: str, source: str) -> str:
    return (f"{where} accepted the connection, then closed it without a greeting: "
            f"either it is not the pre-flight listener of this run, or that listener turned "
            f"this client away (its source address {source or '(any)'} is not among the "
            f"nodes' chosen addresses, e.g. NAT between the nodes; or a crowd of other "
            f"connections pushed it out: see what the listener turned away)")


def _connect_once(source: str, address: str, port: int, timeout_s: float,
                  nonce: str) -> ConnectResult:
    """One probe within ``timeout_s`` in all, tried again (up to :data:`CONNECT_TRIES`)
    while time is left if the listener turned it away without a greeting."""
    start = time.monotonic()
    deadline = start + timeout_s
    tries = 0
    while True:
        tries += 1
        ok, error, turned_away = _attempt(source, address, port, deadline, nonce)
        if ok or not turned_away or tries >= CONNECT_TRIES \
                or deadline - time.monotonic() < 0.2:
            break
        time.sleep(0.05)
    if not ok and turned_away and tries > 1:
        error += f" ({tries} tries)"
    return ConnectResult(ok, error, round((time.monotonic() - start) * 1000, 1))


def probe_peers(source: str, targets: Sequence[Target], timeout_s: float,
                nonce: str) -> dict[int, ConnectResult]:
    """Step 2 on one node: connect to every target at once; keyed by :attr:`Target.node`.

    Each connection opens with ``nonce``, as the listeners of :func:`open_listeners` expect.
    """
    results: dict[int, ConnectResult] = {}
    threads = []
    for target in targets:
        def run(t: Target = target) -> None:
            results[t.node] = _connect_once(source, t.address, t.port, timeout_s, nonce)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout_s + 2.0)
    for target in targets:
        results.setdefault(target.node, ConnectResult(False, "probe thread did not finish"))
    return results
