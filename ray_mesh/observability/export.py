"""Ray's side of ray_mesh's metrics: what is exported, with which tags, and the writer.

The metric definitions (:data:`METRICS`), the tags every series carries (:func:`mesh_tags`),
the writer (:class:`Exporter`: the Ray metric objects of one run, ``ray.util.metrics``; one
per :class:`~ray_mesh.observability.owner.Observability`, so a second run in the same
process starts with a fresh one) and the check that the node's Prometheus endpoint answers.
Ray is imported lazily, inside functions: a torchrun job never loads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import urllib.request
from dataclasses import dataclass
from typing import Any

from ray_mesh.core import bootstrap
from ray_mesh.core.runtime import train_context
from ray_mesh.core.spec import DIM_NAMES
from ray_mesh.network.interfaces import host_port

logger = logging.getLogger(__name__)

TAG_KEYS: tuple[str, ...] = ("run", "rank", "node_rank", "node_ip", *DIM_NAMES)
DIM_TAG_KEYS: tuple[str, ...] = (*TAG_KEYS, "dim")


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: Ray name, kind, help text, and whether it has a ``dim`` tag."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    per_dim: bool = False
    extra_tags: tuple[str, ...] = ()

    @property
    def tag_keys(self) -> tuple[str, ...]:
        return (DIM_TAG_KEYS if self.per_dim else TAG_KEYS) + self.extra_tags

    @property
    def prometheus_name(self) -> str:
        """The series name on Ray's Prometheus endpoint."""
        return "ray_" + self.name + ("_total" if self.kind == "counter" else "")


METRICS: tuple[MetricDef, ...] = (
    # From what the train function passes to ray.train.report (observability.report).
    MetricDef("mesh_step", "gauge", "Last reported training step ('step' key)."),
    MetricDef("mesh_steps", "counter", "Training steps done, from the reported 'step' key."),
    MetricDef("mesh_step_time_seconds", "counter",
              "Wall time between reports, over the steps they span."),
    MetricDef("mesh_step_seconds", "gauge", "Mean step wall time over the last window."),
    MetricDef("mesh_samples", "counter", "Samples processed (the reported 'samples' count)."),
    MetricDef("mesh_tokens", "counter", "Tokens processed (the reported 'tokens' count)."),
    MetricDef("mesh_samples_per_second", "gauge", "Samples/s over the last window."),
    MetricDef("mesh_tokens_per_second", "gauge", "Tokens/s over the last window."),
    MetricDef("mesh_loss", "gauge", "Last reported loss ('loss' key)."),
    MetricDef("mesh_dim_allreduce_seconds", "gauge",
              "Median all-reduce time of probe_dims() on this dim.", per_dim=True),
    MetricDef("mesh_dim_busbw_bytes_per_second", "gauge",
              "All-reduce bus bandwidth of probe_dims() on this dim.", per_dim=True),
    MetricDef("mesh_dim_wait_seconds", "gauge",
              "Seconds of the last wait window the training thread spent blocked in this "
              "dim's collectives (sampled, no user code).", per_dim=True),
    MetricDef("mesh_compute_seconds", "gauge",
              "Seconds of the last wait window outside any collective (compute, data, Python)."),
    MetricDef("mesh_wait_window_seconds", "gauge", "Length of the last wait window."),
    MetricDef("mesh_link_mbit", "gauge",
              "Link throughput between nodes a and b measured at bring-up (Mbit/s; a == b: "
              "within a node). Exported by rank 0.", extra_tags=("a", "b")),
    MetricDef("mesh_process_rss_bytes", "gauge", "Resident memory of the worker process."),
    MetricDef("mesh_device_memory_allocated_bytes", "gauge",
              "torch.cuda.memory_allocated (CUDA only)."),
    MetricDef("mesh_device_memory_reserved_bytes", "gauge",
              "torch.cuda.memory_reserved (CUDA only)."),
    MetricDef("mesh_device_memory_peak_bytes", "gauge",
              "torch.cuda.max_memory_allocated (CUDA only)."),
)
METRICS_BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}


# ----------------------------------------------------------------------------- tags
def run_name() -> str:
    """Ray Train's run (experiment) name, else RAY_MESH_RUN, else 'local'."""
    ctx = train_context()
    if ctx is not None:
        try:
            return str(ctx.get_experiment_name())
        except Exception:  # noqa: BLE001
            pass
    return os.environ.get("RAY_MESH_RUN", "local")


def mesh_tags(run: str | None = None) -> dict[str, str]:
    """The tags every ray_mesh metric carries for this process."""
    state = bootstrap.get_state() if bootstrap.is_initialized() else None
    ctx = train_context()
    rank = state.rank if state else int(os.environ.get("RANK", 0))
    node_rank = os.environ.get("NODE_RANK", "0")
    node_ip = ""
    if ctx is not None:
        try:
            node_rank = str(ctx.get_node_rank())
            import ray

            node_ip = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001
            pass
    coord = state.coordinate if state else {}
    tags = {"run": run or run_name(), "rank": str(rank), "node_rank": str(node_rank),
            "node_ip": node_ip or socket.gethostname()}
    tags.update({d: str(coord.get(d, "")) for d in DIM_NAMES})
    return tags


HOLD_REFRESH_S = 5.0
REPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"  # Ray's, 10 s by default


def hold_refresh_s() -> float:
    """How often held gauges are set again: :data:`HOLD_REFRESH_S`, or half of Ray's metrics
    report interval where a node was started with a shorter one (its workers inherit the
    variable), so that a gauge never reaches the agent's two-interval expiry."""
    try:
        interval_s = float(os.environ.get(REPORT_INTERVAL_ENV, "10000")) / 1000
    except ValueError:
        return HOLD_REFRESH_S
    return max(0.2, min(HOLD_REFRESH_S, interval_s / 2)) if interval_s > 0 else HOLD_REFRESH_S


class Exporter:
    """The Ray metric objects of one run; any failure disables export (one warning).

    ``loud``: warn at WARNING level (each node's local rank 0), else at DEBUG.

    Gauges hold their last value until :meth:`close`: Ray's metrics agent drops a gauge
    series that was not set again within two report intervals (20 s by default;
    upstream: ray-metrics-gauge-expiry), so a value set once (``probe_dims``) or between
    sparse reports would vanish from Prometheus and the dashboard while the run goes on. A
    daemon thread sets every held gauge again each :func:`hold_refresh_s` (5 s, less for a
    shorter interval).
    """

    def __init__(self, loud: bool = True, refresh_s: float | None = None) -> None:
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._held: dict[tuple[str, frozenset], tuple[float, dict[str, str]]] = {}
        self._refresh_s = refresh_s or hold_refresh_s()
        self._closed = threading.Event()
        self._refresher: threading.Thread | None = None
        self.loud = loud
        self.enabled = True
        self.warned = False
        self.checked_endpoint = False

    def _hold(self, name: str, value: float, tags: dict[str, str]) -> None:
        """Keep a gauge's last value for the refresher (called under the lock). One held
        series per metric and per-series tags (``dim``, ``a``/``b``): the process's own
        tags (run, rank, coordinate) are the latest ones, so a series first written before
        Ray Train named the run (``run="local"``) is not kept alive beside the real one."""
        own = frozenset((k, v) for k, v in tags.items() if k not in TAG_KEYS)
        self._held[(name, own)] = (value, tags)
        if self._refresher is None and not self._closed.is_set():
            self._refresher = threading.Thread(target=self._refresh, daemon=True,
                                               name="ray_mesh-metrics-hold")
            self._refresher.start()

    def _refresh(self) -> None:
        while not self._closed.wait(self._refresh_s):
            if not self.enabled:
                return
            try:
                with self._lock:
                    for (name, _), (value, tags) in self._held.items():
                        self._metrics[name].set(value, tags=tags)
            except Exception as exc:  # noqa: BLE001 - metrics must never break training
                self.fail(exc)

    def close(self) -> None:
        """Stop holding gauges (the run ended: Ray then lets them expire). Idempotent."""
        self._closed.set()
        refresher, self._refresher = self._refresher, None
        if refresher is not None and refresher is not threading.current_thread():
            refresher.join(timeout=2 * self._refresh_s)

    def warn_once(self, message: str) -> None:
        if self.warned:
            return
        self.warned = True
        (logger.warning if self.loud else logger.debug)("ray_mesh metrics: %s", message)

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util.metrics import Counter, Gauge

            d = METRICS_BY_NAME[name]
            cls = Counter if d.kind == "counter" else Gauge
            metric = cls(d.name, description=d.help, tag_keys=d.tag_keys)
            self._metrics[name] = metric
        return metric

    def record(self, values: list[tuple[str, float, dict[str, str]]]) -> None:
        """Write (metric, value, tags) triples; gauges are set, counters incremented."""
        if not self.enabled:
            return
        try:
            with self._lock:
                for name, value, tags in values:
                    metric = self._metric(name)
                    if METRICS_BY_NAME[name].kind == "counter":
                        if value > 0:
                            metric.inc(float(value), tags=tags)
                    else:
                        metric.set(float(value), tags=tags)
                        self._hold(name, float(value), tags)
        except Exception as exc:  # noqa: BLE001 - metrics must never break training
            self.fail(exc)

    def gauge(self, name: str, value: float, tags: dict[str, str], help_text: str) -> None:
        """Set a gauge outside :data:`METRICS` (a reported key's ``mesh_report_<key>``)."""
        if not self.enabled:
            return
        try:
            with self._lock:
                metric = self._metrics.get(name)
                if metric is None:
                    from ray.util.metrics import Gauge

                    metric = self._metrics[name] = Gauge(name, description=help_text,
                                                         tag_keys=tuple(tags))
                metric.set(float(value), tags=tags)
                self._hold(name, float(value), tags)
        except Exception as exc:  # noqa: BLE001 - metrics must never break training
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.enabled = False
        self.warn_once(f"exporting to Ray's metrics failed ({type(exc).__name__}: {exc}); "
                       f"training goes on without ray_mesh metrics.")

    def check_endpoint_async(self) -> None:
        """Check the node's endpoint once per run, off the training thread."""
        if self.checked_endpoint:
            return
        self.checked_endpoint = True

        def run() -> None:
            where = None
            with contextlib.suppress(Exception):  # check_endpoint says why itself
                where = metrics_endpoint()
            if where is not None and where[1] <= 0:  # an install choice, not a fault
                if self.loud:
                    logger.info("ray_mesh metrics: %s", no_agent(where[0]))
                return
            problem = check_endpoint(where=where, tries_s=ENDPOINT_TRIES_S[1:])
            if problem:
                self.warn_once(problem + "; training goes on, metrics will not reach "
                               "Prometheus or the dashboard.")

        threading.Thread(target=run, name="ray_mesh-metrics-check", daemon=True).start()


class WindowExporter:
    """``on_window`` for :class:`~ray_mesh.observability.waits.WaitSampler`: writes a window
    (and, on rank 0, the run's link matrix, so it outlives Ray's gauge expiry) as metrics.

    Tags are read at the first window, from the sampler thread, once Ray Train's context
    names the run.
    """

    def __init__(self, exporter: Exporter, links: list[dict[str, Any]] | None = None) -> None:
        self.exporter = exporter
        self.links = links or []
        self.tags: dict[str, str] | None = None

    def __call__(self, window: dict[str, Any]) -> None:
        if self.tags is None or self.tags["run"] == "local":
            self.tags = mesh_tags()
        tags = self.tags
        rec = [("mesh_wait_window_seconds", window["window_s"], tags),
               ("mesh_compute_seconds", window["compute_s"], tags)]
        rec += [("mesh_dim_wait_seconds", secs, {**tags, "dim": label.split("=")[0]})
                for label, secs in window["wait_s"].items()]
        rec += [("mesh_link_mbit", link["mbit_s"], {**tags, "a": link["a"], "b": link["b"]})
                for link in self.links]
        self.exporter.record(rec)


def metrics_endpoint() -> tuple[str, int] | None:
    """(node IP, metrics export port) of this process's Ray node, or None outside Ray."""
    import ray

    if not ray.is_initialized():
        return None
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return node.get("NodeManagerAddress", ""), int(node.get("MetricsExportPort") or 0)
    return None


def no_agent(ip: str) -> str:
    """What a node without Ray's metrics agent means (``ray[train]`` alone has none)."""
    return (f"Ray on node {ip} runs without its metrics agent (ray[train] alone has none), so "
            "ray_mesh's metrics stay in the run's reports; for Prometheus and the dashboard, "
            "pip install 'ray[default]' on every node")


ENDPOINT_TRIES_S = (5.0, 15.0, 30.0)
"""Per-try read limits of the endpoint check: a node running 8 workers on 2 cores once kept
Ray's metrics agent from answering within 5 s, though it was there and served later."""


def _timed_out(exc: BaseException) -> bool:
    """A timeout, raw (a read) or inside urllib's URLError (a connect)."""
    return isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError)


def check_endpoint(timeout_s: float = ENDPOINT_TRIES_S[0], where: tuple[str, int] | None = None,
                   tries_s: tuple[float, ...] | None = None) -> str | None:
    """None when the Prometheus endpoint answers with Ray metrics, else why not.

    ``where`` is (ip, port); by default this process's node, as Ray reports it. A timeout
    is tried again with each limit in ``tries_s`` (after ``timeout_s``): an endpoint that is
    slow to answer on a busy node is there, so only one that never answers is reported, and
    as slow, not as missing (a refused connection is what a missing agent looks like).
    """
    if where is None:
        try:
            where = metrics_endpoint()
        except Exception as exc:  # noqa: BLE001
            return f"cannot look up this node's metrics port ({type(exc).__name__}: {exc})"
    if where is None:
        return "Ray is not initialized in this process"
    ip, port = where
    if port <= 0:  # Ray says -1 where the node runs no metrics agent
        return no_agent(ip)
    url = f"http://{host_port(ip, port)}/metrics"
    limits = (timeout_s, *(tries_s or ()))
    for limit in limits:
        try:
            with urllib.request.urlopen(url, timeout=limit) as resp:  # noqa: S310 - our node
                head = resp.read(1 << 20).decode("utf-8", "replace")
            break
        except Exception as exc:  # noqa: BLE001
            if not _timed_out(exc):
                return (f"Ray's metrics endpoint {url} does not answer ({type(exc).__name__}: "
                        f"{exc}). The node's metrics agent is missing: install ray[default] "
                        f"on every node, and give `ray start --metrics-export-port` a free "
                        f"port outside the worker port range (10002-19999)")
    else:
        tries = ", ".join(f"{x:g}" for x in limits)
        return (f"Ray's metrics endpoint {url} accepts connections but did not answer in "
                f"{len(limits)} tries ({tries} s): the node is too busy to serve it, or its "
                f"metrics agent is stuck (its log: dashboard_agent.log in the node's Ray "
                f"session logs). Fewer workers on the node, or a restart of Ray there, frees it")
    if "ray_" not in head:
        return (f"{url} answers but serves no Ray metrics: another process holds the port. "
                f"Restart Ray with a free --metrics-export-port")
    return None
