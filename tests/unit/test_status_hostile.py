"""``ray-mesh status`` against a cluster that lies: every answer bounded, every bad report
shown as malformed, every remote string escaped, and no storage opened that the viewer did
not name.

The cluster is a real HTTP server on 127.0.0.1 (``tests/helpers/hostile_dashboard.py``)
answering the endpoints a Ray head serves, with what an attacker would put there: ANSI and
OSC escapes, ``\\r``, NUL, a rank ``"0; rm"``, NaN, a 50 MB value, an answer that trickles
a byte at a time, and a storage URI pointing at an "S3" server the test runs and watches.
The time limits here are hang guards (the old code never returned), not timing claims.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hostile_dashboard import (
    Dashboard,
    bytes_route,
    json_route,
    metrics_text,
    node,
    train_run,
    worker,
)

from ray_mesh.status import cluster as st
from ray_mesh.status.html import render

ESC_ATTACK = "evil\x1b[2J\x1b]8;;http://x.example/\x07link\x1b]8;;\x07\r\x00run"
RAW = ("\x1b", "\r", "\x00", "\x07", "\u202e")
HANG_GUARD_S = 60.0


def _guard_s() -> float:
    """The hang guard, stretched on an overloaded machine (helpers share 2 cores)."""
    return HANG_GUARD_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@pytest.fixture
def dash() -> Iterator[Dashboard]:
    d = Dashboard()
    yield d
    d.close()


def _bounded(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``fn()`` in a thread; fails the test if it has not returned within the hang guard."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(_guard_s())
    assert not t.is_alive(), f"still reading after {_guard_s():.0f} s: the read is unbounded"
    return out.get("value"), out.get("error")


def _status_text(url: str, **kwargs: Any) -> str:
    """collect() then format_status(), as the command prints it; a crash fails the test."""
    value, error = _bounded(lambda: st.format_status(st.collect(url, timeout_s=2, **kwargs)))
    assert error is None, f"status crashed: {type(error).__name__}: {error}"
    return value


def _no_raw_controls(text: str) -> None:
    found = [repr(c) for c in RAW if c in text]
    assert not found, f"raw control characters reached the output: {found}"


# ----------------------------------------------------------------------------- escaping
def test_escape_sequences_are_shown_escaped_in_the_console_and_the_page(dash):
    runs = [train_run(ESC_ATTACK, [worker(0, ip="127.0.0.1\x1b[31m"), worker(1)])]
    dash.serve(nodes=[node(state="ALIVE\x1b[0m\r")], runs=runs)
    out = _status_text(dash.url)
    _no_raw_controls(out)
    assert "evil\\x1b[2J\\x1b]8;;http://x.example/\\x07link" in out, out
    assert "127.0.0.1\\x1b[31m" in out and "ALIVE\\x1b[0m\\r" in out, out
    status = _bounded(lambda: st.collect(dash.url, timeout_s=2))[0]
    page = render(status)
    _no_raw_controls(page)
    assert "evil\\x1b[2J" in page


def test_chromium_shows_the_escapes_and_loads_nothing_a_name_points_at(dash, tmp_path):
    """The page in a real browser: markup in a run name is text, control characters are
    visible escapes, and nothing is fetched from where the names point."""
    from test_status_html import CHROMIUM, CHROMIUM_ARGS, _browser

    sync_playwright = _browser()
    bait = Dashboard()
    try:
        name = f"<img src='{bait.url}/img'>\x1b[2J<script>fetch('{bait.url}/js')</script>"
        dash.serve(runs=[train_run(name, [worker(0, ip=f"<a href='{bait.url}'>x</a>"),
                                          worker(1)])])
        status = _bounded(lambda: st.collect(dash.url, timeout_s=2))[0]
        page_file = tmp_path / "mesh.html"
        page_file.write_text(render(status), encoding="utf-8")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium") or CHROMIUM,
                                         args=CHROMIUM_ARGS, timeout=60_000)
            try:
                page = browser.new_page()
                page.goto(page_file.as_uri(), wait_until="load", timeout=30_000)
                text = page.inner_text("body")
            finally:
                browser.close()
        assert "\\x1b[2J" in text and "<img src=" in text and "<script>" in text, text
        _no_raw_controls(text)
        assert bait.seen == [], f"the page fetched {bait.seen}"
    finally:
        bait.close()


def test_hang_and_straggler_reports_escape_what_the_ranks_sent():
    from ray_mesh.observability.hang_report import format_report
    from ray_mesh.observability.slow import format_analysis

    frames = [{"file": "/job/\x1b[2Jtrain.py", "line": 9, "func": "train\r", "code":
               "\x1b]0;owned\x07sleep()"}]
    snap = {"rank": 0, "host": "h\x1b[31m", "pid": 1, "seq": {"dp": 1}, "groups":
            {"dp": [0, 1]}, "stalled_s": {"dp": 30.0}, "pending": None,
            "threads": [{"name": "Main\x00Thread", "frames": frames}]}
    text = format_report({0: snap}, {1: {"seq": {"dp": 0}}}, 2, 60, 75)
    _no_raw_controls(text)
    assert "h\\x1b[31m" in text and "/job/\\x1b[2Jtrain.py" in text, text
    analysis = {"dims": {"dp": {"dim": "dp", "slowest_rank": 1, "node": "n\x1b[2J",
                                "wait_share": 0.1, "peers_wait_share": 0.5,
                                "crosses_nodes": True}},
                "links": [{"a": "a\r", "b": "b\x1b[1m", "mbit_s": 5.0}],
                "verdict": "slow rank 1 (node n\x1b[2J)"}
    lines = "\n".join(format_analysis(analysis))
    _no_raw_controls(lines)
    assert "n\\x1b[2J" in lines and "a\\r" in lines


def test_checkpoint_warnings_escape_file_names(capsys):
    from ray_mesh.checkpointing import train as ckpt_train

    ckpt_train._warn("ray_mesh: leaving /runs/checkpoint_000001\x1b[2J\x1b[1A alone")
    err = capsys.readouterr().err
    _no_raw_controls(err)
    assert "checkpoint_000001\\x1b[2J\\x1b[1A alone" in err


# ----------------------------------------------------------------------------- malformed
def test_a_non_integer_rank_is_malformed_and_the_other_runs_still_show(dash):
    dash.serve(runs=[train_run("bad", [worker("0; rm"), worker(1)]), train_run("good")])
    out = _status_text(dash.url)
    assert "Run bad" in out and "malformed" in out and "'0; rm'" in out, out
    assert "Run good  [RUNNING]" in out, out
    page = render(_bounded(lambda: st.collect(dash.url, timeout_s=2))[0])
    assert "malformed (" in page and "&#x27;0; rm&#x27;" in page and "Run good" in page


MALFORMED_RUNS = {
    "run-not-an-object": ["a string where a run should be"],
    "name-is-a-list": [train_run(["x"])],
    "start-is-text": [train_run("r", start_time_ns="yesterday")],
    "attempts-not-a-list": [train_run("r", attempts={"workers": 1})],
    "rank-is-bool": [train_run("r", [worker(True), worker(1)])],
    "rank-huge": [train_run("r", [worker(10**12), worker(1)])],
    "ranks-twice": [train_run("r", [worker(0), worker(0)])],
    "worker-not-object": [train_run("r", [[0], worker(1)])],
    "gpu-ids-text": [train_run("r", [worker(0, gpu_ids="all"), worker(1)])],
    "name-1mb": [train_run("n" * 2**20)],
}


@pytest.mark.parametrize("runs", MALFORMED_RUNS.values(), ids=MALFORMED_RUNS.keys())
def test_wrong_types_and_huge_fields_are_shown_as_malformed(dash, runs):
    dash.serve(runs=runs)
    out = _status_text(dash.url)
    assert "malformed (" in out, out[:3000]
    assert len(out) < 20_000, f"{len(out)} characters printed"


def test_malformed_nodes_and_answers(dash):
    dash.serve(nodes=[node(), "not a node", node(ip=5), node(resources_total={"CPU": "lots"})])
    out = _status_text(dash.url)
    assert out.count("malformed (") == 3 and "Nodes (1):" in out, out
    dash.routes["/api/train/v2/runs/v1"] = bytes_route(b"[" * 100_000)  # too deep for json
    out = _status_text(dash.url)
    assert "/api/train/v2/runs/v1" in out and "not valid JSON" in out, out


def test_metric_labels_and_values_that_ray_mesh_never_exports(dash):
    bad = metrics_text("hsdp", [("ray_mesh_step", {"rank": "\u00b2"}, "1"),  # "²".isdigit()
                                ("ray_mesh_step", {"rank": "0"}, "NaN"),
                                ("ray_mesh_loss", {"rank": "0"}, "+Inf"),
                                ("ray_mesh_dim_wait_seconds", {"rank": "1", "dim": "\x1b[2J"},
                                 "1"),
                                ("ray_mesh_step", {"rank": "1"}, "7")])
    dash.serve(runs=[train_run("hsdp")], metrics=bad)
    out = _status_text(dash.url)
    _no_raw_controls(out)
    assert "4 metric sample(s) malformed" in out, out
    rows = [ln.split() for ln in out.splitlines() if ln[:1].isdigit()]
    assert [rows[1][0], rows[1][-1]] == ["1", "7"], out  # rank 1's step survived


# ----------------------------------------------------------------------------- size, time
BIG = 50 * 2**20


def test_a_50mb_value_is_not_read_whole(dash):
    dash.serve()
    dash.routes["/api/train/v2/runs/v1"] = dash.big_value(
        {"train_runs": [train_run("@@BIG@@")]}, BIG)
    out = _status_text(dash.url)
    assert len(out) < 20_000, f"{len(out)} characters printed"
    assert "/api/train/v2/runs/v1" in out and "larger than" in out and "MiB" in out, out
    assert "Nodes (1):" in out  # what could be read is still shown


def test_a_50mb_metrics_page_is_not_read_whole(dash):
    dash.serve(runs=[train_run("hsdp")])
    dash.routes["/metrics"] = dash.big(BIG, head=b"ray_mesh_step{run=\"hsdp\",rank=\"0\"} 1\n#")
    out = _status_text(dash.url)
    assert f"127.0.0.1:{dash.port}" in out and "larger than" in out, out


def test_a_trickling_answer_is_cut_at_the_timeout(dash):
    """A byte every 0.3 s: each recv returns in time, so only a deadline on the whole answer
    ends it. The old reader waited as long as the server kept trickling."""
    dash.serve()
    dash.routes["/api/train/v2/runs/v1"] = dash.trickle(0.3)
    out = _status_text(dash.url)
    assert "/api/train/v2/runs/v1" in out and "did not arrive" in out, out


def test_a_slow_run_list_is_asked_again_with_more_time_and_named(dash):
    """The Train state's run list 3 s late, over --timeout 2 s (a head at load 17 on 2
    cores took over 5 s): the second ask, up to 4x as long, gets it, and a note names it.
    Before, the runs were dropped ("runs not read") and the status showed only the nodes."""
    dash.serve(runs=[train_run("hsdp")])
    dash.routes["/api/train/v2/runs/v1"] = dash.slow(dash.routes["/api/train/v2/runs/v1"], 3)
    out = _status_text(dash.url)
    assert "Run hsdp" in out and "runs not read" not in out, out
    assert re.search(r"note: a busy cluster: answered only when asked a second time \(over "
                     r"--timeout 2 s\): the dashboard's answer to /api/train/v2/runs/v1 after "
                     r"\d+ s", out), out


def test_a_second_ask_stops_at_the_deadline_and_only_timeouts_are_asked_again():
    from ray_mesh.errors import SourceError, SourceTimeout
    from ray_mesh.observability.fetch import Deadline, patiently

    bounds: list[float] = []

    def late(bound_s: float) -> str:
        bounds.append(bound_s)
        raise SourceTimeout("late")

    deadline = Deadline(5)
    with pytest.raises(SourceTimeout):
        patiently(late, 2, deadline, "x")
    assert bounds[0] == 2 and 2 < bounds[1] <= 5 and len(bounds) == 2, bounds
    assert deadline.slow == []  # nothing answered: nothing noted as slow

    bounds.clear()
    with pytest.raises(SourceTimeout):  # no time left for a longer second ask
        patiently(late, 2, Deadline(1), "x")
    assert len(bounds) == 1, bounds

    def wrong(bound_s: float) -> str:
        bounds.append(bound_s)
        raise SourceError("larger than 32 MiB")

    bounds.clear()
    with pytest.raises(SourceError, match="larger"):
        patiently(wrong, 2, Deadline(30), "x")
    assert len(bounds) == 1, bounds


def test_a_metrics_target_trickling_its_headers_is_cut(dash):
    dash.serve(runs=[train_run("hsdp")])
    dash.routes["/metrics"] = dash.trickle(0.3, headers=True)
    out = _status_text(dash.url)
    assert f"127.0.0.1:{dash.port}" in out and "did not arrive" in out, out


def test_the_whole_command_has_a_deadline(dash):
    """Four slow metrics endpoints, each within --timeout per answer: the total deadline
    still ends the command, and the note names what was not read."""
    others = [Dashboard() for _ in range(4)]
    try:
        for o in others:
            o.routes["/metrics"] = o.trickle(0.3)
        dash.serve(runs=[train_run("hsdp")])
        dash.routes["/api/prometheus/sd"] = json_route(
            [{"targets": [f"127.0.0.1:{o.port}" for o in others]}])
        value, error = _bounded(lambda: st.format_status(st.collect(
            dash.url, timeout_s=4, total_s=3)))
        assert error is None, error
        assert "did not arrive" in value and "Run hsdp" in value, value
    finally:
        for o in others:
            o.close()


def test_metrics_targets_off_the_cluster_are_not_scraped(dash):
    other = Dashboard()
    try:
        other.routes["/metrics"] = bytes_route(b"")
        dash.serve(runs=[train_run("hsdp")])
        dash.routes["/api/prometheus/sd"] = json_route([{"targets": [
            f"localhost:{other.port}", f"127.0.0.1:{other.port}/x?", "10.255.255.1:80"]}])
        out = _status_text(dash.url)
        assert other.seen == [] and "not one of the cluster's nodes" in out, out
    finally:
        other.close()


# ----------------------------------------------------------------------------- storage
def _layout_doc(interface: str) -> dict[str, Any]:
    return {"run": "hsdp", "mesh": "MeshSpec(dp_shard=2)", "ranks": [
        {"rank": r, "node": 0, "node_ip": "127.0.0.1", "local_rank": r, "device": "cpu",
         "interface": interface, "pp": 0, "dp_replicate": 0, "dp_shard": r, "cp": 0, "tp": 0}
        for r in range(2)]}


def test_a_storage_uri_from_the_cluster_is_not_opened_with_the_viewers_credentials(
        dash, monkeypatch):
    """The cluster names an "S3" endpoint the test runs; the viewer's AWS key must not be
    sent there (the old code signed a request to it with AWS_ACCESS_KEY_ID)."""
    s3 = Dashboard()
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "VIEWER-KEY-ID")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "viewer-secret")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        uri = f"s3://bucket/results?endpoint_override=127.0.0.1:{s3.port}&scheme=http"
        dash.serve(runs=[train_run("hsdp", storage=uri)])
        out = _status_text(dash.url)
        assert s3.seen == [], f"the cluster's storage was contacted: {s3.seen}"
        assert "not opened" in out and "--storage" in out, out
    finally:
        s3.close()


def test_a_local_storage_path_is_read_only_when_the_viewer_names_it(dash, tmp_path):
    results = tmp_path / "results"
    (results / "hsdp").mkdir(parents=True)
    (results / "hsdp" / "ray_mesh_layout.json").write_text(json.dumps(_layout_doc("wg-SEEN")))
    dash.serve(runs=[train_run("hsdp", storage=str(results))])
    out = _status_text(dash.url)
    assert "wg-SEEN" not in out and "(layout from train state)" in out, out
    out = _status_text(dash.url, storage=[str(tmp_path / "elsewhere")])
    assert "wg-SEEN" not in out, out
    out = _status_text(dash.url, storage=[str(results) + "/"])
    assert "wg-SEEN" in out and "(layout from run dir)" in out, out


def test_a_run_name_cannot_leave_the_named_storage(dash, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "ray_mesh_layout.json").write_text(json.dumps(_layout_doc("LEAK")))
    dash.serve(runs=[train_run("../secret", storage=str(results))])
    out = _status_text(dash.url, storage=[str(results)])
    assert "LEAK" not in out and "path component" in out, out


def test_a_malformed_layout_file_falls_back_to_the_train_state(dash, tmp_path):
    results = tmp_path / "results"
    (results / "hsdp").mkdir(parents=True)
    doc = _layout_doc("eth0")
    doc["ranks"][1]["rank"] = "1; rm"
    (results / "hsdp" / "ray_mesh_layout.json").write_text(json.dumps(doc))
    dash.serve(runs=[train_run("hsdp", storage=str(results))])
    out = _status_text(dash.url, storage=[str(results)])
    assert "(layout from train state)" in out and "malformed (" in out, out
    assert "'1; rm'" in out


# ----------------------------------------------------------------------------- the helper
def test_safe_text_escapes_controls_keeps_text_and_is_idempotent():
    from ray_mesh.core.safe import safe_text

    assert safe_text("node-1 ünïcödé 東京") == "node-1 ünïcödé 東京"
    once = safe_text("a\x1b[2Jb\r\n\t\x00\x7f\x9b\u202e\u2028\udcff")
    assert once == "a\\x1b[2Jb\\r\\n\\t\\x00\\x7f\\x9b\\u202e\\u2028\\udcff"
    assert safe_text(once) == once
    assert safe_text("line1\nline2\x1b", multiline=True) == "line1\nline2\\x1b"
    assert safe_text("x" * 10, 4) == "xxxx…(+6 chars)"
    once.encode("utf-8")  # a lone surrogate would make print() raise


def test_storage_reads_are_bounded_too(tmp_path):
    from ray_mesh.observability.fetch import SourceError, read_storage_file

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "f.json").write_bytes(b"x" * 2048)
    assert read_storage_file(str(tmp_path), "run/f.json", timeout_s=10, max_bytes=4096,
                             what="f") == b"x" * 2048
    assert read_storage_file(str(tmp_path), "run/none.json", timeout_s=10, max_bytes=4096,
                             what="f") is None
    with pytest.raises(SourceError, match="larger than"):
        read_storage_file(str(tmp_path), "run/f.json", timeout_s=10, max_bytes=1024,
                          what="f")
