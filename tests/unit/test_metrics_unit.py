"""Monitoring without a cluster: what the recorder makes of reports, layout files, the
deploy/monitoring configs, and ``ray-mesh status`` against addresses that do not answer."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from grafana import dashboard_metric_names

from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.core.topology import WorkerReport, plan_mesh
from ray_mesh.observability.export import Exporter
from ray_mesh.observability.fetch import PATIENCE
from ray_mesh.observability.layout import LAYOUT_JSON, layout_document, read_layout, to_markdown
from ray_mesh.observability.metrics import METRICS, check_endpoint, mesh_tags
from ray_mesh.observability.report import ReportRecorder
from ray_mesh.status.cluster import StatusError, collect

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
EXPORTED = {m.prometheus_name for m in METRICS}


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


# ----------------------------------------------------------------------------- reports
class FakeClock:
    """The recorder's clock: its arithmetic is checked on exact durations, whatever the
    machine's load (timing claims live in benchmarks/)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class RecordingExporter(Exporter):
    """A real Exporter whose writes to Ray are kept in a list instead (what was written)."""

    def __init__(self) -> None:
        super().__init__(loud=True)
        self.records: list[tuple[str, float, dict[str, str]]] = []
        self.gauges: dict[str, float] = {}

    def record(self, values: list[tuple[str, float, dict[str, str]]]) -> None:
        self.records += values

    def gauge(self, name: str, value: float, tags: dict[str, str], help_text: str) -> None:
        self.gauges[name] = value


def test_reports_give_rates_window_metrics_and_summary_from_the_clock():
    """What a train function passes to ray_mesh.report is the only input: step, samples,
    loss. Rates come from the clock between reports; the window from the last flush."""
    clock, lines, exporter = FakeClock(), [], RecordingExporter()
    rec = ReportRecorder(exporter, name="hsdp", total_steps=40, show=lines.append,
                         flush_every_s=3600, clock=clock)
    clock.sleep(30.0)  # start-up before the first report is no step's time
    rec.observe({"step": 1, "loss": 0.8, "samples": 64})
    for step in (10, 20, 30):
        clock.sleep(2.0)  # 10 steps (9 after the first) every 2 s
        rec.observe({"step": step, "loss": 1.0 / step, "samples": 64 * step})
    assert rec.rates["steps_per_s"] == pytest.approx(29 / 6.0)
    assert rec.rates["samples_per_s"] == pytest.approx(64 * 29 / 6.0)
    assert lines[0] == "hsdp: step 1/40 loss 0.8000"
    assert lines[-1] == "hsdp: step 30/40 loss 0.0333  4.83 steps/s  309.3 samples/s  ETA 2s"
    values = rec.flush()
    assert values["step_seconds"] == pytest.approx(6.0 / 29)
    written = {name: value for name, value, _ in exporter.records}
    assert written["mesh_step"] == 30 and written["mesh_loss"] == pytest.approx(1 / 30)
    assert written["mesh_steps"] == 29 and written["mesh_step_time_seconds"] == 6.0
    assert written["mesh_samples_per_second"] == pytest.approx(64 * 29 / 6.0)
    assert written["mesh_process_rss_bytes"] > 10 * 2**20
    assert set(written) <= {m.name for m in METRICS}
    assert exporter.gauges["mesh_report_loss"] == pytest.approx(1 / 30)
    summary = rec.summary()
    assert summary["reports"] == 4 and summary["report_seconds"] == 6.0
    assert summary["last"]["steps_per_s"] == pytest.approx(29 / 6.0)


def test_progress_lines_every_report_of_ten_steps_but_not_every_step():
    clock, lines = FakeClock(), []
    rec = ReportRecorder(None, name="ckpt", total_steps=40, show=lines.append, clock=clock)
    for step in range(1, 41):  # a loop that reports every step, 0.05 s apart
        rec.observe({"step": step, "loss": 0.5})
        clock.sleep(0.05)
    shown = [int(line.split()[2].split("/")[0]) for line in lines]
    assert shown == [1, 11, 21, 31, 40], shown
    assert rec.calls == 40  # every report is recorded, only the lines are fewer
    clock, lines = FakeClock(), []
    rec = ReportRecorder(None, name="hsdp", total_steps=40, show=lines.append, clock=clock)
    for step in (1, 10, 20, 30, 40):  # every 10th step, fast: each report shows
        rec.observe({"step": step, "loss": 0.5})
        clock.sleep(0.2)
    assert len(lines) == 5, lines


def test_a_first_report_shows_the_rate_it_carries_and_later_ones_the_clocks():
    """A replica group that rejoined late may report once in its attempt (seen on a busy
    machine: the laptop back at step 30 of 40, one report at 40): the recorder has no
    interval of its own, so the loop's own tokens_per_s is the line's and the summary's
    rate; from the second report on, the recorder's clock rules, and a reported rate is
    never shown as a plain number."""
    clock, lines = FakeClock(), []
    rec = ReportRecorder(None, name="lab-g2", total_steps=40, show=lines.append, clock=clock)
    clock.sleep(40.0)  # the rejoin and heal: no step's time
    rec.observe({"step": 40, "loss": 2.5, "tokens": 5120, "tokens_per_s": 812.0})
    assert lines == ["lab-g2: step 40/40 loss 2.5000  812 tokens/s"]
    assert rec.summary()["last"]["tokens_per_s"] == 812.0
    rec = ReportRecorder(None, name="lab-g0", total_steps=40, show=lines.append, clock=clock)
    rec.observe({"step": 10, "loss": 3.0, "tokens": 1000, "tokens_per_s": 50.0})
    clock.sleep(2.0)
    rec.observe({"step": 20, "loss": 2.0, "tokens": 3000, "tokens_per_s": 999.0})
    assert lines[-1] == "lab-g0: step 20/40 loss 2.0000  5 steps/s  1000 tokens/s  ETA 4s"
    assert rec.summary()["last"]["tokens_per_s"] == 1000.0


def test_report_without_step_counts_reports_and_shows_other_numbers():
    clock, lines = FakeClock(), []
    rec = ReportRecorder(None, name="x", show=lines.append, clock=clock)
    rec.observe({"loss": 2.0, "lr": 3e-4, "note": "text"})
    clock.sleep(2.0)
    rec.observe({"loss": 1.5, "val/bpb": 3.25})
    assert lines == ["x: step 1 loss 2.0000 lr 0.0003", "x: step 2 loss 1.5000 val/bpb 3.25"
                     "  0.5 steps/s"]

# ----------------------------------------------------------------------------- failures
def _http_server(body: bytes, first_delay_s: float = 0.0):
    """A real HTTP server on a free port answering every GET with ``body`` (the first one
    after ``first_delay_s``: a busy node's agent)."""
    import http.server

    delays = [first_delay_s]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            if delays:
                time.sleep(delays.pop())
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


def test_a_slow_metrics_endpoint_is_tried_again_and_never_called_missing():
    """A busy node's agent once took over 5 s to answer: the warning then said the agent
    was missing (install ray[default]), which was wrong. Now a timeout is tried again with a
    longer limit, and one that never answers is called slow, with a fix that fits."""
    ray_like = _http_server(b"# TYPE ray_node_cpu gauge\nray_node_cpu 1.0\n", first_delay_s=1.5)
    try:
        where = ("127.0.0.1", ray_like.server_address[1])
        assert check_endpoint(0.3, where, tries_s=(5.0,)) is None  # the second try answers
    finally:
        ray_like.shutdown()
    silent = socket.socket()  # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        msg = check_endpoint(0.2, ("127.0.0.1", silent.getsockname()[1]), tries_s=(0.3,))
    finally:
        silent.close()
    assert msg is not None and "did not answer in 2 tries (0.2, 0.3 s)" in msg, msg
    assert "missing" not in msg and "ray[default]" not in msg and "busy" in msg, msg


def test_a_node_without_a_metrics_agent_is_one_info_line_with_the_right_fix(caplog,
                                                                          monkeypatch):
    """Ray reports port -1 where the node runs no metrics agent (``ray[train]`` without
    ``ray[default]``, e.g. the README's embedded main job): not a fault, and no `ray start`
    to give a port to. Before: a WARNING naming http://<ip>:-1/metrics and that hint."""
    import time

    from ray_mesh.observability import export

    msg = check_endpoint(2, ("192.0.2.2", -1))
    assert "without its metrics agent" in msg and "ray[default]" in msg, msg
    assert ":-1" not in msg and "ray start" not in msg, msg
    monkeypatch.setattr(export, "metrics_endpoint", lambda: ("192.0.2.2", -1))
    exporter = Exporter(loud=True)
    with caplog.at_level("DEBUG", logger="ray_mesh.observability.export"):
        exporter.check_endpoint_async()
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.05)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(said) == 1 and said[0][0] == "INFO", said
    assert "without its metrics agent" in said[0][1] and not exporter.warned, said


def test_a_failing_metric_record_warns_once_and_disables_export(caplog):
    """Ray itself rejects the record (a tag is missing): training must not see it."""
    exporter = Exporter(loud=True)
    bad = [("mesh_loss", 1.0, {"run": "x"})]  # the other TAG_KEYS are missing
    with caplog.at_level("DEBUG", logger="ray_mesh.observability.export"):
        exporter.record(bad)
        exporter.record(bad)
        exporter.warn_once("a second problem")
    warned = [r for r in caplog.records if r.name == "ray_mesh.observability.export"]
    assert len(warned) == 1 and warned[0].levelname == "WARNING", warned
    assert "training goes on" in warned[0].getMessage() and not exporter.enabled
    good = [("mesh_loss", 1.0, mesh_tags("x"))]
    quiet = Exporter(loud=False)
    quiet.record(good)  # a valid record passes
    assert quiet.enabled and not quiet.warned


def test_gauges_hold_their_last_value_until_the_exporter_closes():
    """Ray's agent drops a gauge not set within two report intervals (20 s on Ray 2.60): a
    probe_dims result set once vanished from Prometheus mid-run. The exporter sets every
    gauge's last value again until close(); counters are never re-added."""
    sets: list[tuple[str, float, tuple]] = []

    class Metric:
        def __init__(self, name: str) -> None:
            self.name = name

        def set(self, value: float, tags: dict[str, str]) -> None:
            sets.append((self.name, value, tuple(sorted(tags.items()))))

        def inc(self, value: float, tags: dict[str, str]) -> None:
            sets.append((self.name + "+", value, tuple(sorted(tags.items()))))

    class Held(Exporter):
        def _metric(self, name: str) -> Metric:
            return self._metrics.setdefault(name, Metric(name))

    exporter = Held(refresh_s=0.02)
    tags = mesh_tags("x")
    exporter.record([("mesh_dim_allreduce_seconds", 0.5, {**tags, "dim": "dp"}),
                     ("mesh_steps", 3.0, tags)])
    exporter.record([("mesh_dim_allreduce_seconds", 0.25, {**tags, "dim": "dp"})])
    deadline = time.monotonic() + 10
    while sum(name == "mesh_dim_allreduce_seconds" for name, _, _ in sets) < 5:
        assert time.monotonic() < deadline, sets
        time.sleep(0.02)
    # A series written before Ray Train named the run is replaced, not kept beside it.
    exporter.record([("mesh_loss", 1.0, mesh_tags("local")), ("mesh_loss", 2.0, tags)])
    written = len(sets)
    time.sleep(0.2)
    loss_runs = [dict(t)["run"] for name, _, t in sets[written:] if name == "mesh_loss"]
    assert loss_runs and set(loss_runs) == {"x"}, sets[written:]
    exporter.close()
    after_close = len(sets)
    time.sleep(0.1)
    assert len(sets) == after_close, "the refresher went on after close()"
    gauge_sets = [v for name, v, _ in sets if name == "mesh_dim_allreduce_seconds"]
    assert gauge_sets[:2] == [0.5, 0.25] and set(gauge_sets[2:]) == {0.25}, gauge_sets
    assert [v for name, v, _ in sets if name == "mesh_steps+"] == [3.0]  # counted once


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
        # the first ask's 2 s, the second's 4x as long (a busy head answers late), and room
        assert time.monotonic() - t0 < 2 + PATIENCE * 2 + 5
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


def test_held_gauges_are_set_again_within_a_shorter_report_interval(monkeypatch):
    """Ray's agent drops a gauge not set within two report intervals; a node started with
    RAY_metrics_report_interval_ms=2000 expires one after 4 s, which a fixed 5 s refresh
    missed. Half the interval (at most 5 s, at least 0.2 s), whatever the worker inherits."""
    from ray_mesh.observability.export import REPORT_INTERVAL_ENV, Exporter, hold_refresh_s

    for value, want in ((None, 5.0), ("10000", 5.0), ("60000", 5.0), ("2000", 1.0),
                        ("100", 0.2), ("0", 5.0), ("soon", 5.0)):
        if value is None:
            monkeypatch.delenv(REPORT_INTERVAL_ENV, raising=False)
        else:
            monkeypatch.setenv(REPORT_INTERVAL_ENV, value)
        assert hold_refresh_s() == want, (value, hold_refresh_s())
    monkeypatch.setenv(REPORT_INTERVAL_ENV, "2000")
    assert Exporter()._refresh_s == 1.0 and Exporter(refresh_s=0.02)._refresh_s == 0.02
