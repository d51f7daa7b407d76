"""A fake Ray dashboard on 127.0.0.1 that serves whatever a test wants a hostile cluster to say.

A real HTTP server (``ThreadingHTTPServer``), not a mock of ``ray-mesh status``'s code: it
answers the same endpoints a Ray 2.60 head serves (``/api/v0/nodes``, Ray Train's
``/api/train/v2/runs/v1``, ``/api/prometheus/sd``) and a node's ``/metrics``, each from a
route the test sets: JSON, raw bytes, a body of any size written in chunks, or a trickle
(a byte every ``gap_s``, headers or body). Every request is recorded (``seen``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

NODE_ID = "ab" * 28
START_NS = 1_700_000_000_000_000_000


def node(ip: str = "127.0.0.1", **extra: Any) -> dict[str, Any]:
    """One node as the dashboard's state API lists it (``detail=true``)."""
    return {"node_id": NODE_ID, "node_ip": ip, "is_head_node": True, "state": "ALIVE",
            "state_message": None, "node_name": ip, "resources_total": {"CPU": 2.0},
            "labels": {}, "start_time_ms": 0, "end_time_ms": 0, **extra}


def nodes_answer(nodes: list[Any]) -> dict[str, Any]:
    return {"result": True, "msg": "", "data": {"result": {
        "total": len(nodes), "num_after_truncation": len(nodes), "num_filtered": len(nodes),
        "result": nodes, "partial_failure_warning": "", "warnings": None}}}


def worker(rank: Any, ip: str = "127.0.0.1", **extra: Any) -> dict[str, Any]:
    return {"world_rank": rank, "local_rank": rank, "node_rank": 0, "node_ip": ip,
            "gpu_ids": [], **extra}


def train_run(name: Any = "hsdp", workers: list[Any] | None = None,
              storage: Any = "/nonexistent/ray_results", **extra: Any) -> dict[str, Any]:
    """A RUNNING ray_mesh run as Ray Train's state API describes it."""
    return {"id": "0123456789abcdef", "name": name, "status": "RUNNING",
            "start_time_ns": START_NS,
            "run_settings": {"backend_config": {"config": {"mesh": {"dp_shard": -1}}},
                             "run_config": {"storage_path": storage}},
            "attempts": [{"workers": workers if workers is not None else
                          [worker(0), worker(1)]}],
            **extra}


Route = Callable[[BaseHTTPRequestHandler], None]


def send(handler: BaseHTTPRequestHandler, body: bytes, ctype: str = "application/json",
         length: bool = True) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", ctype)
    if length:
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def json_route(doc: Any) -> Route:
    data = json.dumps(doc).encode()
    return lambda h: send(h, data)


def bytes_route(data: bytes, ctype: str = "text/plain") -> Route:
    return lambda h: send(h, data, ctype)


class Dashboard:
    """Routes by path prefix; ``close()`` also ends any trickle still running."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.seen: list[str] = []
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.seen.append(self.path)
                for prefix, route in outer.routes.items():
                    if self.path.startswith(prefix):
                        # OSError: the client hung up (as a bounded reader does)
                        with contextlib.suppress(OSError):
                            route(self)
                        return
                self.send_error(404)

            def do_HEAD(self) -> None:  # noqa: N802 - an S3 client's first request
                outer.seen.append(f"HEAD {self.path}")
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def serve(self, nodes: list[Any] | None = None, runs: list[Any] | None = None,
              metrics: bytes | None = None) -> Dashboard:
        """The usual routes: one node (this machine), the runs, metrics on this server."""
        self.routes["/api/v0/nodes"] = json_route(nodes_answer(nodes or [node()]))
        self.routes["/api/train/v2/runs/v1"] = json_route({"train_runs": runs or []})
        self.routes["/api/prometheus/sd"] = json_route(
            [{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{self.port}"]}])
        self.routes["/metrics"] = bytes_route(metrics or b"")
        return self

    def big(self, size: int, head: bytes = b"", fill: bytes = b"x") -> Route:
        """A body of ``size`` bytes (no length header), written in 1 MiB chunks."""
        def route(h: BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.end_headers()
            h.wfile.write(head)
            left, chunk = size - len(head), fill * (2**20 // len(fill))
            while left > 0 and not self.stop.is_set():
                h.wfile.write(chunk[:left])
                left -= len(chunk)
        return route

    def big_value(self, doc: Any, size: int, placeholder: str = "@@BIG@@") -> Route:
        """``doc`` as JSON with the string ``placeholder`` replaced by ``size`` x's: valid
        JSON holding one huge value, sent with its length, in 1 MiB chunks."""
        head, tail = json.dumps(doc).encode().split(placeholder.encode(), 1)

        def route(h: BaseHTTPRequestHandler) -> None:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(head) + size + len(tail)))
            h.end_headers()
            h.wfile.write(head)
            left, chunk = size, b"x" * 2**20
            while left > 0 and not self.stop.is_set():
                h.wfile.write(chunk[:left])
                left -= len(chunk)
            h.wfile.write(tail)
        return route

    def trickle(self, gap_s: float = 0.3, headers: bool = False) -> Route:
        """A byte every ``gap_s`` until closed: the body (or, with ``headers``, the header
        lines) never ends, yet no single read waits longer than ``gap_s``."""
        def route(h: BaseHTTPRequestHandler) -> None:
            h.wfile.write(b"HTTP/1.0 200 OK\r\n")
            if not headers:
                h.wfile.write(b"Content-Type: application/json\r\n\r\n[")
            h.wfile.flush()
            while not self.stop.wait(gap_s):
                h.wfile.write(b"X" if headers else b" ")
                h.wfile.flush()
        return route

    def slow(self, route: Route, delay_s: float) -> Route:
        """``route``'s answer after ``delay_s`` of silence (a head far past its cores)."""
        def delayed(h: BaseHTTPRequestHandler) -> None:
            if not self.stop.wait(delay_s):
                route(h)
        return delayed

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def metrics_text(run: str, lines: list[tuple[str, dict[str, str], str]]) -> bytes:
    """Prometheus text: ``ray_mesh_*`` gauges with the given labels and raw values."""
    out = []
    for name, labels, value in lines:
        tags = ",".join(f'{k}="{v}"' for k, v in {"run": run, **labels}.items())
        out += [f"# TYPE {name} gauge", f"{name}{{{tags}}} {value}"]
    return ("\n".join(out) + "\n").encode()


def wait_until(check: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return check()
