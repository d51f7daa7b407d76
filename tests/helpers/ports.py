"""A free TCP port on loopback, for a test's own rendezvous (torchrun's --master-port)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
