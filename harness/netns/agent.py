"""A Python process inside one namespace node that runs module-level functions on request
(Ray-free checks across nodes, e.g. the pre-flight's worker-side steps)."""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from harness.netns.namespaces import Node

REPO = Path(__file__).resolve().parents[2]


class NamespaceAgent:
    """A Python process inside one namespace that runs module-level functions on request.

    For Ray-free checks across nodes (e.g. the pre-flight's worker-side steps): state such
    as open listeners lives on in the process between calls. Requests and answers are
    pickles, one length-prefixed frame each, over the process's stdin/stdout.
    """

    _SERVER = textwrap.dedent("""\
        import pickle, struct, sys
        inp, out = sys.stdin.buffer, sys.stdout.buffer
        sys.stdout = sys.stderr
        while True:
            head = inp.read(4)
            if len(head) < 4:
                break
            fn, args = pickle.loads(inp.read(struct.unpack(">I", head)[0]))
            try:
                reply = ("ok", fn(*args))
            except Exception as exc:
                reply = ("error", f"{type(exc).__name__}: {exc}")
            data = pickle.dumps(reply)
            out.write(struct.pack(">I", len(data)) + data)
            out.flush()
    """)

    def __init__(self, node: Node, env: dict[str, str]) -> None:
        env = {**env, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([*node.exec_prefix(), sys.executable, "-c", self._SERVER],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.lock = threading.Lock()

    def call(self, fn, *args):
        """Run ``fn(*args)`` in the namespace; returns its value or raises RuntimeError."""
        data = pickle.dumps((fn, args))
        with self.lock:
            assert self.proc.stdin and self.proc.stdout
            self.proc.stdin.write(struct.pack(">I", len(data)) + data)
            self.proc.stdin.flush()
            head = self.proc.stdout.read(4)
            if len(head) < 4:
                raise RuntimeError("the namespace agent exited")
            status, value = pickle.loads(self.proc.stdout.read(struct.unpack(">I", head)[0]))
        if status != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


__all__ = ["NamespaceAgent"]
