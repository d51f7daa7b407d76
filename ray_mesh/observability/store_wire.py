"""Reading a rendezvous-store value's length before its bytes: the hang watch's bounded read.

``TCPStore.get`` returns a value whole, and a value has no size limit the reader can set:
the server refuses a single ``set`` over 8 MiB, but ``append`` grows a key without bound
(measured: 20 appends make a 160 MiB ``snap/1``, which a watch reading with ``get`` reads
whole at every poll). The watch's limits (``hang_store.LIMITS``, 64 KiB for a heartbeat),
checked after ``get``, would apply only once the whole value has arrived. No public API
reads a value's length first, so :class:`BoundedReader` speaks the store's wire protocol on
a connection of its own: the client's ``VALIDATE`` greeting, then ``GET`` (a key as a 64-bit
length and bytes; the answer a 64-bit length, then the bytes). It reads the length, and a
value over the caller's limit is never read: the connection is dropped and opened afresh
next time.

The protocol is torch's internal (``c10d::detail::QueryType``, ``TCPStoreBackend.hpp``;
checked on torch 2.13 with the libuv server, ``tests/unit/test_hang_store.py``;
upstream: torch-store-get-unbounded). Should a later torch speak differently,
:meth:`BoundedReader.works` (a probe key written through the public API and read back here)
says so at start-up, and the watch falls back to ``get``.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from ray_mesh.errors import Oversize

CHECKED_TORCH = "2.13.0"
_VALIDATE, _GET = 0, 3  # c10d::detail::QueryType
_MAGIC = 0x3C85F7CE  # c10d::detail::validationMagicNumber


class BoundedReader:
    """``get(key, limit)`` of a ``PrefixStore(prefix, TCPStore(host, port))``'s keys."""

    def __init__(self, host: str, port: int, prefix: str, timeout_s: float = 10.0) -> None:
        self.host, self.port, self.prefix, self.timeout_s = host, port, prefix, timeout_s
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            sock.sendall(struct.pack("<BI", _VALIDATE, _MAGIC))
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _recv(self, sock: socket.socket, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            got = sock.recv(min(n - len(data), 1 << 16))
            if not got:
                raise ConnectionError("the rendezvous store closed the connection")
            data += got
        return bytes(data)

    def get(self, key: str, limit: int) -> bytes:
        """The value of ``key`` (the caller checked it exists); :class:`Oversize` without
        reading it when longer than ``limit``; OSError when the store is not reachable."""
        # TCPStore's client puts "/" before every key; PrefixStore joins with "/".
        name = f"/{self.prefix}/{key}".encode()
        try:
            sock = self._connect()
            sock.sendall(struct.pack("<BQ", _GET, len(name)) + name)
            (size,) = struct.unpack("<Q", self._recv(sock, 8))
            if size > limit:
                self.close()  # the rest of the value is never read
                raise Oversize(size)
            return self._recv(sock, size)
        except OSError:
            self.close()
            raise

    def works(self, store: Any, rank: int) -> bool:
        """Whether this torch's store answers as expected: a probe key set through the
        public API reads back the same here."""
        probe, value = f"wire_probe/{rank}", f"ray_mesh wire probe {rank}".encode()
        try:
            store.set(probe, value)
            return self.get(probe, 1024) == value
        except (OSError, Oversize, struct.error):
            self.close()
            return False
