"""Live monitoring: a Ray cluster of our own, a monitored run, and everything that shows it.

One module fixture starts (as subprocesses this module owns and kills by process group):

* a head node with a fixed ``--metrics-export-port`` (outside 10002-19999) and the dashboard;
* ``ray-mesh run`` of ``examples/hsdp_metrics.py`` on it (4 workers, 2x2 HSDP mesh), running
  until the test drops its stop file.

The checks then read what a user would read: Prometheus text from the metrics port, the
Train run state from the dashboard's HTTP API, ``ray-mesh status``, a Chromium screenshot,
and the layout files in the run directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from console import problems
from ports import free_port

from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.observability.metrics import METRICS
from ray_mesh.status.cluster import parse_series

pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[2]
RUN = "meshmon"
BATCH, SLEEP = 16, 0.05
DP = 4  # dp ranks (dp_replicate 2 x dp_shard 2): the example reports the global samples
SPEC = MeshSpec(dp_replicate=2, dp_shard=2)
PROBED = ("dp_replicate", "dp_shard", "dp", "dp_shard_cp", "dp_cp")
START_TIMEOUT_S = 120
METRICS_TIMEOUT_S = 240
# Ray exports metrics every RAY_metrics_report_interval_ms (10 s by default) and drops a gauge
# not set again within 2 intervals (ray/_private/telemetry/open_telemetry_metric_recorder.py,
# Ray 2.60). This cluster reports every 2 s: the series show up and a gauge would expire 5x
# sooner, so the checks below wait ~25 s less for the same thing.
REPORT_INTERVAL_MS = 2000
GAUGE_EXPIRY_S = 2 * REPORT_INTERVAL_MS / 1000 + 4  # 4 s of margin


HEAD_ATTEMPTS = 3


class HeadExited(AssertionError):
    """``ray start --block`` of the head ended (a port taken between its choice and its bind)."""


def _ports(*flags: str) -> list[str]:
    out = []
    for flag in flags:
        out += [flag, str(free_port())]
    return out


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except AssertionError:
            raise  # the predicate's verdict (the run ended early): no point polling on
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last = exc
        time.sleep(interval_s)
    raise AssertionError(f"{what} not within {timeout_s:.0f} s (last: {last!r})")


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop a process we started with start_new_session=True, and its whole group.

    The head's group (``ray start --block`` and every Ray process under it) outlived a 20 s
    SIGTERM grace (21.5 s of teardown); the cluster is thrown away, its temp dir removed: a
    short grace (1 s), then SIGKILL."""
    for sig, grace_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or the group never looks empty
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def _job_yaml(path: Path, name: str, config: dict, mesh: dict | str, scaling: dict,
              storage: Path) -> Path:
    """The shipped examples/hsdp_metrics.yaml, as its header says to run it (``--address``,
    state tracking on), with this module's run name, config, scaling and storage."""
    import yaml

    job = yaml.safe_load((REPO / "examples" / "hsdp_metrics.yaml").read_text())
    file, _, fn = job["train"].partition(":")
    job.update({"name": name, "train": f"{REPO / 'examples' / file}:{fn}",
                "config": {**job["config"], **config}, "mesh": mesh,
                "scaling": {**job["scaling"], **scaling},
                "run": {"storage_path": str(storage)}})
    path.write_text(yaml.safe_dump(job))
    return path


class Cluster:
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="rm6_", dir="/tmp"))  # short: socket paths
        self.env = {**os.environ, "RAY_AUTH_MODE": "token",
                    "RAY_TRAIN_ENABLE_STATE_TRACKING": "1", "PYTHONUNBUFFERED": "1",
                    "RAY_metrics_report_interval_ms": str(REPORT_INTERVAL_MS)}
        self.pick_ports()
        self.storage = self.tmp / "results"
        self.stop_file = self.tmp / "stop"
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.node_ip = ""
        self.head_dir = self.tmp / "h1"  # the head's --temp-dir (another if it is started again)
        self.first_reported: float | None = None

    def pick_ports(self) -> None:
        """The head's GCS, dashboard and metrics ports: free when chosen, not reserved."""
        self.gcs, self.dash, self.metrics = free_port(), free_port(), free_port()

    def spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.logs[name] = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            self.procs[name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env or self.env,
                cwd=self.tmp, start_new_session=True)
        return self.procs[name]

    def output(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dash}"

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.gcs}"

    def metrics_text(self) -> str:
        url = f"http://{self.node_ip}:{self.metrics}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()

    def dashboard_json(self, path: str):
        from ray_mesh.status.cluster import _auth_headers, _enable_token_auth

        _enable_token_auth()
        req = urllib.request.Request(self.dashboard + path, headers=_auth_headers())
        with urllib.request.urlopen(req, timeout=15) as r:
            return json.loads(r.read())

    def close(self) -> None:
        for name in reversed(list(self.procs)):
            _kill_group(self.procs[name])
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_local):
    # ray_local: the session's other Ray instance on this machine, on purpose. Ray Train's
    # own state-API calls auto-detected the cluster and printed "Found multiple active Ray
    # instances" tracebacks on the run's console (the job's worker hook now names it).
    c = Cluster()
    try:
        # The `ray` CLI of this interpreter, also where its console script is not beside it
        # (a venv over system site-packages).
        ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]

        def common() -> list[str]:  # fixed ports, each node its own: others run Ray here too
            return ["--block", "--disable-usage-stats",
                    *_ports("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                            "--runtime-env-agent-port", "--node-manager-port",
                            "--object-manager-port")]

        # The ports are free when chosen, not reserved: another process of this machine (the
        # session's Ray starts workers all the time) can take one before Ray binds it, and
        # `ray start --block` then exits. A head that exits is started again on new ports;
        # one that never answers fails with its own output.
        for attempt in range(1, HEAD_ATTEMPTS + 1):
            if attempt > 1:
                c.pick_ports()
            c.head_dir = c.tmp / f"h{attempt}"
            head = c.spawn("head", [*ray_cli, "start", "--head", f"--port={c.gcs}",
                                    "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                                    f"--dashboard-port={c.dash}",
                                    f"--metrics-export-port={c.metrics}",
                                    *_ports("--ray-client-server-port"),
                                    f"--temp-dir={c.head_dir}", "--num-cpus=4",
                                    '--resources={"head_slot": 4}', *common()])

            def answered(head=head):
                if head.poll() is not None:
                    raise HeadExited(f"ray start exited ({head.returncode})")
                return [n for n in c.dashboard_json("/nodes?view=summary")["data"]["summary"]
                        if n.get("ip")]

            # The summary can list the node before its record carries an IP: wait for that too.
            try:
                info = _wait(answered, START_TIMEOUT_S,
                             "the head's dashboard answering with the node's IP")
                break
            except HeadExited:
                if attempt == HEAD_ATTEMPTS:
                    raise AssertionError(f"the head exited {attempt} times; its output:\n"
                                         f"{c.output('head')[-3000:]}") from None
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the head's output:\n"
                                     f"{c.output('head')[-3000:]}") from None
        c.node_ip = info[0]["ip"]

        main_job = _job_yaml(
            c.tmp / f"{RUN}.yaml", RUN,
            {"steps": 5000, "batch_size": BATCH, "report_every": 10, "step_sleep_s": SLEEP,
             "flush_s": 1.0, "stop_file": str(c.stop_file)},
            {"dp_replicate": 2, "dp_shard": -1},
            {"num_workers": 4, "use_gpu": False,
             "resources_per_worker": {"CPU": 1, "head_slot": 1}}, c.storage)
        ray_mesh_bin = str(Path(sys.executable).with_name("ray-mesh"))
        c.spawn("run", [ray_mesh_bin, "run", str(main_job), "--address", c.address])
        yield c
    finally:
        if c.tmp.exists():
            c.stop_file.touch()
        c.close()


def _samples(c: Cluster, run: str = RUN) -> list[tuple[str, dict, float]]:
    return [s for s in parse_series(c.metrics_text()) if s[1].get("run") == run]


def _by(samples, name: str, **labels) -> dict[int, float]:
    return {int(lab["rank"]): v for n, lab, v in samples
            if n == name and all(lab.get(k) == str(x) for k, x in labels.items())}


def _all_ranks_reported(c: Cluster):
    s = _samples(c)
    ranks = _by(s, "ray_mesh_step")
    probes = [_by(s, "ray_mesh_dim_allreduce_seconds", dim=d) for d in PROBED]
    if len(ranks) == 4 and all(len(p) == 4 for p in probes):
        return s
    if c.procs["run"].poll() is not None:
        raise AssertionError("the run ended early:\n" + c.output("run")[-3000:])
    return None


def _first_reported(c: Cluster) -> float:
    """When every rank's series (the once-set probe_dims ones too) was first seen."""
    if c.first_reported is None:
        _wait(lambda: _all_ranks_reported(c), METRICS_TIMEOUT_S,
              "ray_mesh series of 4 ranks on the metrics endpoint")
        c.first_reported = time.monotonic()
    return c.first_reported


def _reported_past_gauge_expiry(c: Cluster) -> list:
    """Every rank's series, GAUGE_EXPIRY_S after they were first seen: Ray's agent drops a
    gauge not set again within 2 report intervals, and probe_dims sets its gauges once (the exporter
    holds them; without that these series vanished mid-run)."""
    time.sleep(max(0.0, _first_reported(c) + GAUGE_EXPIRY_S - time.monotonic()))
    return _wait(lambda: _all_ranks_reported(c), 10, "ray_mesh series (the probe_dims "
                 f"gauges among them) {GAUGE_EXPIRY_S:.0f} s after they were first seen")


def test_prometheus_series_carry_mesh_tags_and_plausible_values(cluster):
    _first_reported(cluster)
    samples = _all_ranks_reported(cluster) or _reported_past_gauge_expiry(cluster)
    steps = _by(samples, "ray_mesh_step")
    for name, labels, _ in samples:
        rank = int(labels["rank"])
        coord = SPEC.coordinate(rank)
        assert {d: labels[d] for d in DIM_NAMES} == {d: str(coord[d]) for d in DIM_NAMES}, \
            (name, labels)
        assert labels["node_ip"] == cluster.node_ip == labels["NodeAddress"]
        assert labels["node_rank"] == "0"
    step_s = _by(samples, "ray_mesh_step_seconds")
    rate = _by(samples, "ray_mesh_samples_per_second")
    loss = _by(samples, "ray_mesh_loss")
    rss = _by(samples, "ray_mesh_process_rss_bytes")
    for r in range(4):
        assert steps[r] >= 1
        assert SLEEP <= step_s[r] < 10, step_s
        # samples/s is over the window's wall time, which holds all of the window's steps
        # (and whatever the loop does between them: reporting, waiting); the example
        # reports the global count (BATCH per dp rank, 2 dp ranks).
        assert 0 < rate[r] <= 1.01 * DP * BATCH / step_s[r], (rate, step_s)
        assert 0 < loss[r] < 5, loss
        assert 50 * 2**20 < rss[r] < 32 * 2**30, rss
        for d in PROBED:
            secs = _by(samples, "ray_mesh_dim_allreduce_seconds", dim=d)[r]
            bw = _by(samples, "ray_mesh_dim_busbw_bytes_per_second", dim=d)[r]
            assert 0 < secs < 10 and bw > 0, (d, secs, bw)
    # Counters move while the run goes on, and agree with the gauges.
    total0 = _by(samples, "ray_mesh_steps_total")
    later = _wait(lambda: (lambda s: s if min(_by(s, "ray_mesh_steps_total").values())
                           > max(total0.values()) else None)(_samples(cluster)),
                  60, "ray_mesh_steps_total to grow")
    steps_total = _by(later, "ray_mesh_steps_total")
    time_total = _by(later, "ray_mesh_step_time_seconds_total")
    samples_total = _by(later, "ray_mesh_samples_total")
    for r in range(4):
        # Windows are counted from the first report on (the counters' first report is
        # their zero): samples and steps move together, a scrape may fall between two
        # records of one window (2 s, steps >= SLEEP).
        assert abs(samples_total[r] - DP * BATCH * steps_total[r]) <= DP * BATCH * 2 / SLEEP
        assert SLEEP <= time_total[r] / steps_total[r] < 10


def test_numbers_passed_to_ray_train_report_become_mesh_tagged_series(cluster):
    """examples/hsdp_metrics.py calls ray_mesh.report; the run's recorder turns each number
    into ray_mesh_report_<key>, plus a derived step rate."""

    def ready():
        s = _samples(cluster)
        want = ("ray_mesh_report_loss", "ray_mesh_report_step",
                "ray_mesh_report_steps_per_second")
        return s if all(len(_by(s, n)) == 4 for n in want) else None

    samples = _wait(ready, METRICS_TIMEOUT_S, "ray_mesh_report_* series of 4 ranks")
    for name, labels, _ in samples:
        if name.startswith("ray_mesh_report_"):
            coord = SPEC.coordinate(int(labels["rank"]))
            assert {d: labels[d] for d in DIM_NAMES} == {d: str(coord[d]) for d in DIM_NAMES}
            assert labels["node_ip"] == cluster.node_ip
    loss, rate = _by(samples, "ray_mesh_report_loss"), _by(samples,
                                                           "ray_mesh_report_steps_per_second")
    for r in range(4):
        assert 0 < loss[r] < 5, loss
        assert 0 < rate[r] <= 1.01 / SLEEP, rate  # a step sleeps SLEEP at least
        assert _by(samples, "ray_mesh_report_step")[r] >= 1


def test_prometheus_recipe_targets_are_in_rays_service_discovery_file(cluster):
    """deploy/monitoring/prometheus.yml reads this file: it must list the endpoint we scrape."""
    sd = json.loads((cluster.head_dir / "prom_metrics_service_discovery.json").read_text())
    targets = [t for group in sd for t in group["targets"]]
    assert f"{cluster.node_ip}:{cluster.metrics}" in targets, targets


# pytest runs a module's tests in the order written: the two checks that read no metrics run
# here, during the GAUGE_EXPIRY_S that the checks below wait out after the series were first
# seen (run after those checks, they added ~5 s that this wait now covers).
def test_dashboard_train_api_shows_the_run(cluster):
    def running():
        runs = cluster.dashboard_json("/api/train/v2/runs/v1")["train_runs"]
        run = next((r for r in runs if r["name"] == RUN and r["status"] == "RUNNING"), None)
        return run if run and len(run["attempts"][-1]["workers"]) == 4 else None

    run = _wait(running, START_TIMEOUT_S, f"run {RUN} RUNNING in the Train state API", 2)
    backend = run["run_settings"]["backend_config"]["config"]
    assert backend["mesh"]["dp_replicate"] == 2 and backend["mesh"]["dp_shard"] == -1
    workers = run["attempts"][-1]["workers"]
    assert sorted(w["world_rank"] for w in workers) == [0, 1, 2, 3]
    assert {w["node_ip"] for w in workers} == {cluster.node_ip}
    assert run["run_settings"]["run_config"]["storage_path"] == str(cluster.storage)


def test_dashboard_screenshot_shows_the_run(cluster, tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from dashboard_screenshot import screenshot
    finally:
        sys.path.pop(0)
    jobs = cluster.dashboard_json("/api/jobs/")
    job_id = next(j["job_id"] for j in jobs if f"{RUN}.yaml" in (j.get("entrypoint") or ""))
    out = tmp_path / "dashboard_actors.png"  # pytest keeps the last runs' tmp dirs: look at it
    # The Actors page lists the run's Train workers (its driver's job id) while it runs.
    text = screenshot(cluster.dashboard, str(out), page="#/actors", wait_for="RayTrainWorker",
                      timeout_s=90)
    assert job_id in text and "ALIVE" in text, text[:1000]
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1600, 1000)


def test_grafana_dashboard_queries_live_series(cluster):
    """Every ray_mesh series the Grafana dashboard plots exists on a CPU run's endpoint."""
    from grafana import dashboard_metric_names

    live = {n for n, _, _ in _reported_past_gauge_expiry(cluster)}
    # CUDA memory, tokens (this run counts samples) and node links (one node: none measured)
    cuda_or_tokens = {m.prometheus_name for m in METRICS
                      if "device_memory" in m.name or "token" in m.name or "link" in m.name}
    missing = dashboard_metric_names() - cuda_or_tokens - live
    assert not missing, f"dashboard queries series the run does not export: {missing}"


def _status_rows(out: str, run: str) -> list[dict[str, str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"Run {run} "))
    header = lines[start + 1].split()
    rows = []
    for line in lines[start + 3:]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(dict(zip(header, line.split(), strict=True)))
    return rows


def test_status_shows_nodes_run_layout_and_latest_metrics(cluster):
    _reported_past_gauge_expiry(cluster)
    cli = str(Path(sys.executable).with_name("ray-mesh"))
    res = subprocess.run([cli, "status", "--address", cluster.address, "--storage",
                          str(cluster.storage)], env=cluster.env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert f"Run {RUN}  [RUNNING]" in out and "(layout from run dir)" in out, out
    assert "Nodes (1):" in out and cluster.node_ip in out, out
    rows = _status_rows(out, RUN)
    assert [int(r["rank"]) for r in rows] == [0, 1, 2, 3], out
    for r in rows:
        coord = SPEC.coordinate(int(r["rank"]))
        assert {d: int(r[d]) for d in DIM_NAMES} == {d: coord[d] for d in DIM_NAMES}, out
        assert r["interface"] not in ("", "?") and r["node_ip"] == cluster.node_ip
        assert float(r["step"]) >= 1 and SLEEP <= float(r["step_s"]) < 10, out
        assert 0 < float(r["loss"]) < 5, out
    # The wait sampler's series reach status with no code in the example: per dim the
    # slowest rank, and a verdict line (which one depends on the load of this host).
    assert "dp_shard      slowest rank" in out and "\n  verdict: " in out, out


def test_run_stops_cleanly_and_saved_its_layout(cluster):
    cluster.stop_file.touch()
    proc = cluster.procs["run"]
    proc.wait(180)
    out = cluster.output("run")
    assert proc.returncode == 0, out[-4000:]
    assert f"run {RUN!r} finished" in out, out[-2000:]
    assert "ray_mesh metrics:" not in out  # the head's endpoint answered: no warning
    # The console of examples/hsdp_metrics.yaml, run as its header says: what
    # test_console_examples.py checks for every other example (COVERED_ELSEWHERE there).
    bad = problems(out)
    assert not bad, "unexpected console lines:\n" + "\n".join(bad[:40])
    doc = json.loads((cluster.storage / RUN / "ray_mesh_layout.json").read_text())
    assert doc["run"] == RUN and doc["num_nodes"] == 1 and doc["workers_per_node"] == 4
    for row in doc["ranks"]:
        coord = SPEC.coordinate(row["rank"])
        assert {d: row[d] for d in DIM_NAMES} == {d: coord[d] for d in DIM_NAMES}
        assert row["node_ip"] == cluster.node_ip and row["interface"]
    md = (cluster.storage / RUN / "ray_mesh_layout.md").read_text()
    assert md.count("\n| ") == 5 and "dp_replicate" in md  # header + 4 ranks
