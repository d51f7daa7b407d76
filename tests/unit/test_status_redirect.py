"""``ray-mesh status`` never sends the cluster token to another origin on a redirect.

Two real HTTP servers on 127.0.0.1 (two ports: two origins). The "dashboard" answers 302 to
the other; the other records the headers it got.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ray_mesh.status import cluster as status

TOKEN = "Bearer s3cret-cluster-token"


class _Server:
    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        self.redirect_to: str | None = None
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.seen.append({"path": self.path, **{k.lower(): v for k, v in
                                                         self.headers.items()}})
                if outer.redirect_to and not self.path.startswith("/same"):
                    target = (outer.url + "/same" + self.path if self.path.startswith("/loop")
                              else outer.redirect_to + self.path)
                    self.send_response(302)
                    self.send_header("Location", target)
                    self.end_headers()
                    return
                body = json.dumps({"ok": True, "auth": self.headers.get("Authorization")})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[_Server, _Server]]:
    dashboard, other = _Server(), _Server()
    dashboard.redirect_to = other.url
    yield dashboard, other
    dashboard.close()
    other.close()


def test_cross_origin_redirect_drops_the_token(servers):
    dashboard, other = servers
    headers = {"Authorization": TOKEN, "X-Ray-Authorization": TOKEN, "Accept": "text/plain"}
    body = json.loads(status._get(dashboard.url + "/api/train/v2/runs/v1", 5, headers))
    assert body == {"ok": True, "auth": None}
    assert dashboard.seen[0]["authorization"] == TOKEN  # the dashboard itself got it
    (got,) = other.seen
    assert got["path"] == "/api/train/v2/runs/v1"
    assert "authorization" not in got and "x-ray-authorization" not in got, got
    assert got.get("accept") == "text/plain"  # harmless headers still go along


def test_same_origin_redirect_keeps_the_token(servers):
    dashboard, other = servers
    body = json.loads(status._get(dashboard.url + "/loop/x", 5, {"Authorization": TOKEN}))
    assert body["auth"] == TOKEN and not other.seen
    assert [s["path"] for s in dashboard.seen] == ["/loop/x", "/same/loop/x"]


def test_dashboard_json_goes_through_the_guard(servers, monkeypatch):
    dashboard, other = servers
    monkeypatch.setattr(status, "_auth_headers", lambda: {"Authorization": TOKEN})
    assert status._dashboard_json(dashboard.url, "/api/prometheus/sd", 5)["ok"] is True
    assert other.seen and "authorization" not in other.seen[0]


def test_origin_compares_scheme_host_and_port():
    assert status._origin("http://h:80/a") == status._origin("http://H/b")
    assert status._origin("https://h/a") != status._origin("http://h/a")
    assert status._origin("http://h:8265/") != status._origin("http://h:8266/")
