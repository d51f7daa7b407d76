"""Monitoring without a cluster: the meter's arithmetic and cost, layout files, the
deploy/monitoring configs, and ``ray-mesh status`` against addresses that do not answer."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.core.topology import WorkerReport, plan_mesh
from ray_mesh.observability.export import _Exporter
from ray_mesh.observability.layout import LAYOUT_JSON, layout_document, read_layout, to_markdown
from ray_mesh.observability.metrics import METRICS, StepMeter, check_endpoint, mesh_tags
from ray_mesh.observability.status import StatusError, collect

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
EXPORTED = {m.prometheus_name for m in METRICS}


def dashboard_metric_names() -> set[str]:
    """Every ray_* series name the Grafana dashboard's queries and variables use."""
    dash = json.loads((MONITORING / "grafana_ray_mesh.json").read_text())
    text = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    text += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return {n for t in text for n in re.findall(r"\bray_[a-zA-Z0-9_]+", t)}


# ----------------------------------------------------------------------------- deploy
def test_grafana_dashboard_is_valid_and_plots_only_exported_metrics():
    dash = json.loads((MONITORING / "grafana_ray_mesh.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert p["datasource"]["uid"] == "${datasource}" and "gridPos" in p
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]
    names = dashboard_metric_names()
    assert names and names <= EXPORTED, names - EXPORTED
    # Every exported series is on some panel.
    assert names == EXPORTED, EXPORTED - names
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "run", "dim"} <= set(variables)
    per_dim = [p for p in panels if any("dim" in t["expr"] for t in p["targets"])]
    assert len(per_dim) >= 3 and any(p.get("repeat") == "dim" for p in per_dim)
    for p in per_dim:
        assert all('dim=~"$dim"' in t["expr"] for t in p["targets"]), p["title"]


def test_prometheus_config_follows_rays_service_discovery_file():
    conf = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    assert conf["global"]["scrape_interval"].endswith("s")
    jobs = {j["job_name"]: j for j in conf["scrape_configs"]}
    files = jobs["ray"]["file_sd_configs"][0]["files"]
    assert "/tmp/ray/prom_metrics_service_discovery.json" in files


# ----------------------------------------------------------------------------- meter
class FakeClock:
    """Stands in for ``time`` inside the metrics module: the meter's arithmetic is checked
    on exact durations, whatever the machine's load (timing claims live in benchmarks/)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    from ray_mesh.observability import meter

    fake = FakeClock()
    monkeypatch.setattr(meter, "time", fake)
    return fake


def test_step_meter_window_numbers_follow_the_clock(clock):
    meter = StepMeter(samples_per_step=8, flush_every_s=1000, export=False)
    clock.sleep(0.05)  # idle before the first step counts in the window's wall time
    for i in range(5):
        with meter.step() as s:
            clock.sleep(0.02 + 0.001 * i)
            with meter.collective("dp"):
                clock.sleep(0.01)
            s.loss = torch.tensor(0.5 + i)
    with pytest.raises(RuntimeError), meter.step():
        clock.sleep(1.0)
        raise RuntimeError("a failed step is not counted")
    out = meter.flush()
    steps = [0.03 + 0.001 * i for i in range(5)]
    assert out["step"] == 5
    assert out["step_time_s"] == pytest.approx(sum(steps) / 5)
    assert out["step_time_max_s"] == pytest.approx(max(steps))
    assert out["collective_s/dp"] == pytest.approx(0.05)
    assert out["collective_fraction/dp"] == pytest.approx(0.05 / sum(steps))
    # Throughput over the window's wall time (idle and the failed step included).
    assert out["samples_per_s"] == pytest.approx(5 * 8 / (0.05 + sum(steps) + 1.0))
    assert out["loss"] == pytest.approx(4.5)  # the last step's loss, read at flush
    assert out["rss_bytes"] > 10 * 2**20
    assert meter.summary() == out
    again = meter.flush()  # an empty window keeps the last step numbers, not loss or dims
    assert again["step_time_s"] == out["step_time_s"] and "collective_s/dp" not in again


def test_step_meter_flushes_on_its_interval_and_rejects_bad_input(clock):
    meter = StepMeter(flush_every_s=0.05, export=False)
    with meter.step():
        clock.sleep(0.01)
    assert meter.summary() == {}  # 0.01 s into a 0.05 s window: not flushed yet
    clock.sleep(0.04)
    with meter.step():
        clock.sleep(0.01)
    assert meter.summary()["step"] == 2  # the step that ended past the interval flushed
    assert meter.summary()["step_time_s"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="dp_shard"):
        meter.collective("data")
    with pytest.raises(ValueError, match="flush_every_s"):
        StepMeter(flush_every_s=0)


def test_step_meter_per_step_path_is_bookkeeping_only():
    """Between flushes a step reads the clock and adds numbers: no flush, no export, no
    tensor read (a device sync on GPU), no psutil. Counted by the profiler, not timed: the
    cost in microseconds is a benchmark figure (benchmarks/run.py, section e)."""
    meter = StepMeter(samples_per_step=8, flush_every_s=3600, export=False)
    loss = torch.tensor(1.0)
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)
        elif event == "c_call":
            calls.append(getattr(arg, "__qualname__", repr(arg)))

    sys.setprofile(profile)
    try:
        for _ in range(100):
            with meter.step() as s:
                s.loss = loss
    finally:
        sys.setprofile(None)
    per_step = {name: calls.count(name) / 100 for name in set(calls) - {"setprofile"}}
    assert per_step == {"step": 1, "__enter__": 1, "__exit__": 1, "record_step": 1,
                        "perf_counter": 3}, per_step
    assert meter.step_index == 100 and meter.summary() == {}


# ----------------------------------------------------------------------------- failures
def _http_server(body: bytes):
    """A real HTTP server on a free port answering every GET with ``body``."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_check_endpoint_names_what_is_wrong_with_the_metrics_port():
    port = _closed_port()
    msg = check_endpoint(2, ("127.0.0.1", port))
    assert f"http://127.0.0.1:{port}/metrics does not answer" in msg
    assert "ray[default]" in msg and "--metrics-export-port" in msg
    other = _http_server(b"<html>someone else's server</html>")
    ray_like = _http_server(b"# TYPE ray_node_cpu gauge\nray_node_cpu 1.0\n")
    try:
        msg = check_endpoint(2, ("127.0.0.1", other.server_address[1]))
        assert "another process holds the port" in msg
        assert check_endpoint(2, ("127.0.0.1", ray_like.server_address[1])) is None
    finally:
        other.shutdown()
        ray_like.shutdown()


def test_a_failing_metric_record_warns_once_and_disables_export(caplog):
    """Ray itself rejects the record (a tag is missing): training must not see it."""
    exporter = _Exporter()
    bad = [("mesh_loss", 1.0, {"run": "x"})]  # the other TAG_KEYS are missing
    with caplog.at_level("DEBUG", logger="ray_mesh.observability.export"):
        exporter.record(bad, loud=True)
        exporter.record(bad, loud=True)
        exporter.warn_once("a second problem", loud=True)
    warned = [r for r in caplog.records if r.name == "ray_mesh.observability.export"]
    assert len(warned) == 1 and warned[0].levelname == "WARNING", warned
    assert "training goes on" in warned[0].getMessage() and not exporter.enabled
    good = [("mesh_loss", 1.0, mesh_tags("x"))]
    quiet = _Exporter()
    quiet.record(good, loud=False)  # a valid record passes
    assert quiet.enabled and not quiet.warned


# ----------------------------------------------------------------------------- layout
def _plan():
    workers = [WorkerReport(rank=r, node_id=f"node{r // 2}", node_ip=f"10.0.0.{r // 2 + 1}",
                            hostname=f"host{r // 2}", local_rank=r % 2) for r in range(4)]
    return plan_mesh(MeshSpec(dp_replicate="nodes", dp_shard=-1), workers)


def test_layout_document_and_markdown_place_every_rank(tmp_path):
    plan = _plan()
    doc = layout_document(plan, {r: "tailscale0" for r in range(4)}, run="demo")
    assert doc["num_nodes"] == 2 and doc["workers_per_node"] == 2
    assert doc["shape"] == dict(zip(DIM_NAMES, plan.spec.shape, strict=True))
    for row in doc["ranks"]:
        coord = plan.spec.coordinate(row["rank"])
        assert {d: row[d] for d in DIM_NAMES} == {d: coord[d] for d in DIM_NAMES}
        assert row["node"] == row["rank"] // 2 and row["hostname"] == f"host{row['node']}"
        assert row["interface"] == "tailscale0"
    md = to_markdown(doc)
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4 and "| 3 | 1 | 10.0.0.2 | host1 |" in md
    assert read_layout(str(tmp_path), "demo") is None
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / LAYOUT_JSON).write_text(json.dumps(doc))
    assert read_layout(str(tmp_path), "demo") == doc


# ----------------------------------------------------------------------------- status
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_against_addresses_that_do_not_answer_fails_fast():
    port = _closed_port()
    for address, what in ((f"127.0.0.1:{port}", "Ray cluster (GCS)"),
                          (f"http://127.0.0.1:{port}", "Ray dashboard")):
        t0 = time.monotonic()
        with pytest.raises(StatusError) as err:
            collect(address, timeout_s=3)
        assert time.monotonic() - t0 < 5
        msg = str(err.value)
        assert what in msg and f"127.0.0.1:{port}" in msg and "ray status" in msg
    with pytest.raises(StatusError, match="Ray Client address"):
        collect("ray://127.0.0.1:10001")


def test_status_against_a_silent_listener_is_bounded():
    """A port that accepts but never answers (a wedged head) times out, not hangs."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    stop = threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                held.append(srv.accept()[0])

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(StatusError):
            collect(f"http://127.0.0.1:{srv.getsockname()[1]}", timeout_s=2)
        assert time.monotonic() - t0 < 15
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()


def test_status_cli_reports_an_unreachable_cluster():
    port = _closed_port()
    res = subprocess.run([str(Path(sys.executable).with_name("ray-mesh")), "status",
                          "--address", f"127.0.0.1:{port}", "--timeout", "2"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "does not answer" in res.stderr and f"127.0.0.1:{port}" in res.stderr
