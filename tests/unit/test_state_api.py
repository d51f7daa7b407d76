"""Telling a slow Ray state API from an absent one (ray_mesh/raytrain/state_api.py).

Each outcome comes from a real call of Ray's ``list_nodes`` over HTTP to a local stand-in
dashboard (tests/helpers/hostile_dashboard.py: a real server, no mock of Ray): one that
answers late, a port nobody listens on, one that answers with an error. No Ray cluster is
started: the state client talks HTTP only when given an ``http://`` address.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest
from hostile_dashboard import Dashboard, json_route, node, nodes_answer, send

from ray_mesh.raytrain import state_api
from ray_mesh.raytrain.state_api import Verdict

INSTALL_HINT = "install ray[default]"


def _slow_nodes(delay_s: float, slow_for: int = 10**6):
    """Answer ``/api/v0/nodes`` properly, the first ``slow_for`` times after ``delay_s``."""
    calls = {"n": 0}
    body = json_route(nodes_answer([node()]))

    def route(h):
        calls["n"] += 1
        if calls["n"] <= slow_for:
            time.sleep(delay_s)
        body(h)
    return route


@pytest.fixture
def dash():
    d = Dashboard()
    yield d
    d.stop.set()
    d.httpd.shutdown()
    d.httpd.server_close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_a_timeout_is_slow_and_keeps_tracking_on_without_the_install_hint(dash):
    dash.routes["/api/v0/nodes"] = _slow_nodes(6.0)
    p = state_api.probe(dash.url, timeout_s=3)
    assert p.verdict is Verdict.SLOW and p.verdict.tracking
    assert p.seconds < 5.5, p  # bounded by the probe's timeout, not the server's delay
    msg = state_api.message(p)
    assert "slow to answer" in msg and "stays on" in msg and dash.url in msg
    assert INSTALL_HINT not in msg and "no dashboard" not in msg


def test_an_answer_is_answers(dash):
    dash.serve()
    p = state_api.probe(dash.url, timeout_s=3)
    assert p.verdict is Verdict.ANSWERS and p.verdict.tracking, p
    assert state_api.message(p) == ""


def test_a_refused_connection_is_no_dashboard_and_turns_tracking_off():
    url = f"http://127.0.0.1:{_closed_port()}"
    p = state_api.probe(url, timeout_s=3)
    assert p.verdict is Verdict.NO_DASHBOARD and not p.verdict.tracking, p
    msg = state_api.message(p)
    assert url in msg and "--include-dashboard" in msg and "is off" in msg
    assert INSTALL_HINT not in msg


def test_an_error_answer_is_an_error_named_in_the_message(dash):
    dash.routes["/api/v0/nodes"] = lambda h: send(h, b'{"result": false, "msg": "boom"}')
    p = state_api.probe(dash.url, timeout_s=3)
    assert p.verdict is Verdict.ERROR and not p.verdict.tracking, p
    msg = state_api.message(p)
    assert "boom" in msg and INSTALL_HINT not in msg


def test_a_missing_client_module_is_not_installed_and_says_so():
    try:
        import ray_mesh_no_such_module  # noqa: F401
    except ImportError as exc:
        missing = exc
    assert state_api.classify(missing) is Verdict.NOT_INSTALLED
    # Ray's own guard when `requests` is absent (ray/util/state/api.py, Ray 2.60)
    guard = RuntimeError("The Ray state CLI & SDK require the ray[default] installation")
    assert state_api.classify(guard) is Verdict.NOT_INSTALLED
    p = state_api.Probe(Verdict.NOT_INSTALLED, "", "ModuleNotFoundError: requests", 0.0)
    assert INSTALL_HINT in state_api.message(p)


def test_a_wrapped_timeout_counts_as_slow_not_as_refused():
    """Ray wraps both in ServerUnavailable with the same install-hint text; ConnectTimeout
    is also a ConnectionError: the timeout must win."""
    import requests
    from ray.util.state.exception import ServerUnavailable

    for cause, want in ((requests.exceptions.ConnectTimeout(), Verdict.SLOW),
                        (requests.exceptions.ReadTimeout(), Verdict.SLOW),
                        (requests.exceptions.ConnectionError(), Verdict.NO_DASHBOARD),
                        (ValueError("Couldn't obtain the API server address"), Verdict.ERROR)):
        try:
            try:
                raise cause
            except Exception:  # as Ray does: the cause only in __context__
                raise ServerUnavailable("... `pip install ray[default]` ...")  # noqa: B904
        except ServerUnavailable as exc:
            assert state_api.classify(exc) is want, (cause, want)
    assert state_api.classify(None) is Verdict.ANSWERS


def test_retry_reports_the_answer_when_a_slow_api_catches_up(dash, caplog):
    dash.routes["/api/v0/nodes"] = _slow_nodes(4.0, slow_for=1)
    caplog.set_level(logging.INFO, logger=state_api.__name__)
    t = state_api.retry_in_background(dash.url, budget_s=30, timeouts_s=(2.0, 5.0),
                                      pauses_s=(0.1,))
    t.join(30)
    assert not t.is_alive()
    lines = [r.getMessage() for r in caplog.records]
    assert any("answers now" in m and dash.url in m for m in lines), lines


def test_retry_gives_up_within_its_budget_with_one_warning(dash, caplog):
    dash.routes["/api/v0/nodes"] = _slow_nodes(30.0)
    caplog.set_level(logging.INFO, logger=state_api.__name__)
    t0 = time.monotonic()
    t = state_api.retry_in_background(dash.url, budget_s=4, timeouts_s=(1.0,),
                                      pauses_s=(0.2, 0.4))
    t.join(15)
    assert not t.is_alive() and time.monotonic() - t0 < 10
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "still did not answer" in warned[0], warned
