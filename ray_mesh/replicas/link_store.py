"""The replica groups' cross-group store: bound to the node's address, its values signed.

Why: the run's coordinator hosts the ``TCPStore`` on which the groups' cross-group gloo
process groups meet (:mod:`.link`), under ``replicas/<epoch>/<inner rank>/``. torch's
``TCPStore(host, 0, is_master=True)`` listens on every interface and has no authentication:
any host that reaches the port could write a member's gloo address there and so take part
in the heal broadcast (the full model and optimizer state) and the averages, or hand gloo a
value it cannot parse (a crafted length makes it allocate without bound). So

* :func:`serve_store` binds the port itself, on the node's address only, and hands the
  socket to torch (``TCPStore(master_listen_fd=...)``, as the job's rendezvous store is
  bound in :mod:`ray_mesh.core.rendezvous_store`, whose ``RAY_MESH_STORE_BIND=all`` gives
  the all-interfaces bind back here too, for a node behind NAT); it returns the store's
  address with a fresh random key, which reaches the groups through Ray's token-checked
  actor calls only;
* :class:`SignedStore`, the store the link gives gloo, prefixes what a member writes with an
  HMAC-SHA256 of (key, value) under that key, and refuses, before gloo parses anything, a
  value that is oversized, too short to hold a tag, or whose tag does not match: a
  :class:`~ray_mesh.errors.BootstrapError` that says a client other than the run's groups
  wrote it (the step is retried, :mod:`.group`). A stranger can still delete or overwrite a
  key (the rendezvous then fails) and fill the server's memory: the firewall recipe is what
  keeps it off the port (docs/trust-model.md).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import secrets
import socket
from datetime import timedelta

import torch.distributed as dist

from ray_mesh.core.rendezvous_store import STORE_BIND_ENV, bind_address
from ray_mesh.errors import BootstrapError

KEY_BYTES = 32
TAG_BYTES = hashlib.sha256().digest_size
MAX_VALUE_BYTES = 64 * 1024
"""What a member reads may be this long at most (tag included). gloo's rendezvous value is a
few hundred bytes (its address, and 8 bytes per member): 64 KiB leaves room for thousands of
members and keeps a stranger's megabytes from being handed to gloo's parser."""
StoreAddress = tuple[str, int, str]
"""(host, port, key as hex): what the coordinator hands each group."""
_FIX = ("Only this run's replica groups may write to it, but the store has no "
        "authentication: keep other hosts off the port (deploy/tailscale/firewall.sh with "
        "RAY_MESH_FW_PEERS, docs/trust-model.md); the step is retried on a new epoch.")


def _listen(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` (an IP address of this node), on a free port; on
    every interface with ``RAY_MESH_STORE_BIND=all``."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        raise BootstrapError(
            f"The replica groups' store must listen on an IP address of this node, not "
            f"{host!r}: the node's address from Ray (ray.util.get_node_ip_address()) is "
            f"one.") from None
    bound = bind_address(host)  # None: RAY_MESH_STORE_BIND=all
    address = bound or ("::" if ":" in host else "0.0.0.0")
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET,
                         socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind((address, 0))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        hint = (f"{address} is not an address of this node: start Ray on this node with "
                f"--node-ip-address set to one of its own addresses (its tailnet address); "
                f"behind NAT, set {STORE_BIND_ENV}=all to listen on every interface and close "
                f"the port with a firewall"
                if exc.errno == errno.EADDRNOTAVAIL else "check the node's network settings")
        raise BootstrapError(f"The replica groups' store could not listen on {address}: "
                             f"{exc.strerror or exc}. {hint}.") from None
    return sock


def serve_store(host: str) -> tuple[dist.TCPStore, StoreAddress]:
    """The cross-group store's server, listening on ``host`` only (never ``*``), and its
    :data:`StoreAddress` with a fresh key. The caller keeps the store: it stops with it."""
    sock = _listen(host)
    port = int(sock.getsockname()[1])
    store = dist.TCPStore(host.strip("[]"), port, is_master=True, wait_for_workers=False,
                          master_listen_fd=sock.detach())  # torch owns and closes the fd
    return store, (host.strip("[]"), port, secrets.token_hex(KEY_BYTES))


def parse_key(key: str) -> bytes:
    """The signing key from its hex form (:func:`serve_store`); a clear error otherwise."""
    try:
        raw = bytes.fromhex(key)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != KEY_BYTES:
        raise BootstrapError(
            f"The replica groups' store key must be {2 * KEY_BYTES} hex digits, as the "
            f"coordinator makes it (replicas.link_store.serve_store); got "
            f"{len(key) if isinstance(key, str) else type(key).__name__} characters. Pass "
            f"the key of Coordinator.store_address() unchanged.")
    return raw


class SignedStore(dist.Store):
    """``inner`` (a ``PrefixStore`` under ``prefix``) for gloo's rendezvous: every value set is
    signed with ``key``, every value got is checked first (the module docstring says why)."""

    def __init__(self, inner: dist.Store, prefix: str, key: bytes, where: str) -> None:
        super().__init__()
        self.inner, self.prefix, self.key, self.where = inner, prefix, key, where

    def _tag(self, key: str, value: bytes) -> bytes:
        message = f"{self.prefix}{key}".encode() + b"\0" + value
        return hmac.new(self.key, message, hashlib.sha256).digest()

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self._tag(key, data) + data)

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        if len(raw) > MAX_VALUE_BYTES:
            why = f"holds {len(raw)} bytes, more than the {MAX_VALUE_BYTES} a member writes"
        elif len(raw) < TAG_BYTES:
            why = f"holds {len(raw)} bytes, too short for the {TAG_BYTES}-byte signature"
        elif not hmac.compare_digest(raw[:TAG_BYTES], self._tag(key, raw[TAG_BYTES:])):
            why = "is not signed with this run's key"
        else:
            return raw[TAG_BYTES:]
        raise BootstrapError(
            f"The replica groups' store ({self.where}) key {self.prefix + key!r} {why}: a "
            f"client other than this run's groups wrote it, so the cross-group link "
            f"refuses it. {_FIX}")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
