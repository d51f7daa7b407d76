"""Free TCP ports for a test's own listeners.

``free_port()`` asks the test's own network namespace, which is right for torchrun on this host.
A listener inside a namespace node must ask that node instead (``free_port_in``): a Ray cluster
in the node holds ports there (its gRPC servers and their ephemeral peers) that the host's
namespace never sees, so a port free on the host can be taken in the node (EADDRINUSE).
"""

from __future__ import annotations

import socket
import subprocess
import sys

# Below the kernel's ephemeral range (32768-60999 by default) and above Ray's worker ports
# (10002-19999), so no outgoing connection or Ray worker in the node takes it after the probe.
_QUIET = (20000, 32767)

_PROBE = """
import socket, sys
low, high = int(sys.argv[1]), int(sys.argv[2])
for port in range(low, high):
    with socket.socket() as s:
        try:
            s.bind((sys.argv[3], port))
        except OSError:
            continue
        print(port)
        break
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_in(prefix: list[str], address: str = "0.0.0.0") -> int:
    """A port free on ``address`` inside the namespace that ``prefix`` enters, outside the
    ephemeral and Ray-worker ranges; the probe starts at a point of the quiet range that
    varies by call (an OS-chosen port), so callers spread over it."""
    low, high = _QUIET
    first = low + free_port() % (high - low - 200)
    out = subprocess.run([*prefix, sys.executable, "-c", _PROBE, str(first), str(high), address],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"no free port in the namespace: {out.stderr.strip()}")
    return int(out.stdout.strip())
