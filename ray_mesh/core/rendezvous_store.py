"""The job's rendezvous store: bound to MASTER_ADDR, and what a rank reads from it checked.

Why: torch's ``env://`` rendezvous makes rank 0 a ``TCPStore`` server on ``*:MASTER_PORT``
(every interface; ``MASTER_ADDR`` only tells the other ranks where to connect) and the store
has no authentication: any host that reaches the port can read and write every key, the
join counter and the gloo addresses included (docs/trust-model.md;
upstream: torch-store-binds-all-interfaces). ray_mesh therefore

* binds the port itself, on ``MASTER_ADDR`` only, and hands the socket to torch's public
  ``TCPStore(master_listen_fd=...)`` (torch 2.13 takes ownership of the descriptor and
  closes it with the store); a ``MASTER_ADDR`` that is a host name, or
  ``RAY_MESH_STORE_BIND=all``, keeps torch's own all-interfaces bind;
* reads its join counter defensively (:func:`join_round`): a value that is not an integer,
  lies outside the range a run can reach, or names a rank slot already taken in its round is
  refused with a message that says so, instead of being adopted.

Under ``torchrun`` the elastic agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE=True``)
and binds it as torch decides (all interfaces); every rank is a client, so only the checks
apply there, and the firewall recipe (deploy/tailscale/firewall.sh) is what limits who connects.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import secrets
import socket
from datetime import timedelta

import torch.distributed as dist

from ray_mesh.errors import BootstrapError

logger = logging.getLogger(__name__)

STORE_BIND_ENV = "RAY_MESH_STORE_BIND"
"""``addr`` (default): rank 0 binds the store to MASTER_ADDR; ``all``: every interface, as
torch does (behind NAT, where MASTER_ADDR is not an address of rank 0's host)."""
JOIN_KEY = "ray_mesh/joined"
CLAIM_PREFIX = "ray_mesh/claimed"
MAX_ROUNDS = 100_000
"""Joinings of the world one store can see (init_mesh/shutdown_mesh cycles, torchrun
restarts); a join counter beyond ``world_size * MAX_ROUNDS`` was not written by ranks."""
_FIX = ("Only this job's ranks may write to the rendezvous store (MASTER_ADDR:MASTER_PORT), "
        "but it has no authentication: start the run again on a fresh MASTER_PORT and keep "
        "other hosts off the port (deploy/tailscale/firewall.sh with RAY_MESH_FW_PEERS; "
        "docs/trust-model.md).")


def _torchelastic_agent_store() -> bool:
    """torchrun's agent hosts the store (the same test torch's ``env://`` handler makes)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def bind_address(master_addr: str) -> str | None:
    """The address rank 0 binds the store to: MASTER_ADDR when it is an IP address, else None
    (torch's all-interfaces bind: a host name may resolve differently here than on peers)."""
    mode = os.environ.get(STORE_BIND_ENV, "addr").strip().lower()
    if mode == "all":
        return None
    if mode != "addr":
        raise BootstrapError(
            f"{STORE_BIND_ENV}={os.environ[STORE_BIND_ENV]!r}: use 'addr' (bind the rendezvous "
            f"store to MASTER_ADDR, the default) or 'all' (every interface, as torch does).")
    try:
        return str(ipaddress.ip_address(master_addr.strip("[]")))
    except ValueError:
        return None


def listen_socket(address: str, port: int) -> socket.socket | None:
    """A listening TCP socket on ``address:port``; None when the port is in use (torch then
    tries itself: a multi-tenant store of this process reuses its server, else torch raises
    its usual address-in-use error)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind((address, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise BootstrapError(
                f"MASTER_ADDR={address} is not an address of this host, so rank 0 cannot bind "
                f"the rendezvous store there (ray_mesh binds it to MASTER_ADDR only, so that "
                f"other interfaces cannot reach it). Run rank 0 on the host that owns "
                f"{address}, or set MASTER_ADDR to one of this host's addresses; behind NAT, "
                f"set {STORE_BIND_ENV}=all to listen on every interface as torch does, and "
                f"close the port with a firewall.") from exc
        raise BootstrapError(
            f"rank 0 could not listen on {address}:{port} for the rendezvous store: "
            f"{exc}. Pick another MASTER_PORT.") from exc
    return sock


def create_store(master_addr: str, port: int, rank: int, world_size: int,
                 timeout: timedelta) -> dist.Store:
    """What torch's ``env://`` handler creates, with rank 0's server bound to MASTER_ADDR.

    Same arguments as ``torch.distributed.rendezvous._create_c10d_store`` (torch 2.13):
    multi-tenant, libuv unless ``USE_LIBUV=0``, the server waiting for ``world_size`` users
    (upstream: torch-store-binds-all-interfaces).
    """
    if not 0 <= port < 2**16:
        raise BootstrapError(f"MASTER_PORT={port} is not a port number (0-65535).")
    use_libuv = os.environ.get("USE_LIBUV", "1") == "1"
    if _torchelastic_agent_store():
        return dist.TCPStore(host_name=master_addr, port=port, world_size=world_size,
                             is_master=False, timeout=timeout)
    kwargs: dict = {}
    if rank == 0:
        address = bind_address(master_addr)
        sock = listen_socket(address, port) if address else None
        if sock is not None:
            kwargs["master_listen_fd"] = sock.detach()  # torch owns and closes it
            logger.debug("rendezvous store bound to %s:%d", address, port)
    return dist.TCPStore(host_name=master_addr, port=port, world_size=world_size,
                         is_master=rank == 0, timeout=timeout, multi_tenant=True,
                         use_libuv=use_libuv, **kwargs)


def _as_count(raw: bytes | str, what: str, world_size: int) -> int:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} chars)"
    limit = world_size * MAX_ROUNDS
    if not (text.isascii() and text.isdigit() and len(text) <= 19) or int(text) > limit:
        raise BootstrapError(
            f"The rendezvous store's join counter {JOIN_KEY!r} {what} {shown!r}, not a join "
            f"count between 0 and {limit} (world size {world_size} x {MAX_ROUNDS} joinings): "
            f"a client other than this job's ranks wrote it. {_FIX}")
    return int(text)


def join_round(store: dist.Store, rank: int, world_size: int) -> int:
    """The number of this joining of the world: every rank adds 1 to the join counter, so
    the ranks of round r read r * world_size + 1 .. (r + 1) * world_size.

    The counter is read first without blocking or changing it (``compare_set`` on a missing
    key creates "0"): ``add`` on a non-integer makes torch's server drop the connection.
    Then this rank claims its slot in the round; a slot already claimed means the counter
    was moved back (a round's keys would be reused: gloo would read stale addresses) or
    forward between two of this round's ranks.
    """
    _as_count(store.compare_set(JOIN_KEY, "", "0"), "holds", world_size)
    try:
        joined = store.add(JOIN_KEY, 1)
    except RuntimeError as exc:  # DistNetworkError: the server dropped us (a non-integer)
        raise BootstrapError(
            f"Adding to the rendezvous store's join counter {JOIN_KEY!r} failed ({exc}): it "
            f"no longer holds an integer, so a client other than this job's ranks wrote it. "
            f"{_FIX}") from exc
    joined = _as_count(str(joined), "reached", world_size)
    if joined < 1:
        raise BootstrapError(f"The join counter {JOIN_KEY!r} reached {joined} after "
                                   f"this rank's add: it was moved below zero. {_FIX}")
    round_ = (joined - 1) // world_size
    mine = f"{joined} pid {os.getpid()} {secrets.token_hex(4)}"  # unique to this claim
    taken = store.compare_set(f"{CLAIM_PREFIX}/{round_}/{rank}", "", mine)
    taken = taken.decode(errors="replace") if isinstance(taken, bytes) else str(taken)
    if taken != mine:
        raise BootstrapError(
            f"Rank {rank}'s slot in joining #{round_} of the world is already taken (by "
            f"{taken[:60]!r}; this rank got join number {joined}): the join counter {JOIN_KEY!r} "
            f"was moved by a client outside this round, another client of the store or an "
            f"earlier attempt whose ranks did not all join. {_FIX}")
    return round_
