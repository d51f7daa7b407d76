"""Mesh-aware training metrics on Ray's metrics pipeline (``ray.util.metrics`` -> Prometheus).

One :class:`StepMeter` per training process::

    meter = ray_mesh.observability.metrics.StepMeter(samples_per_step=batch * dp)
    for step in range(steps):
        with meter.step() as s:
            loss = train_step(...)
            s.loss = loss
        with meter.collective("dp"):          # a collective the loop issues itself
            dist.all_reduce(t, group=mesh.get_group("dp"))
    meter.close()

Why this shape:

* One record into a Ray metric costs 10-20 us (measured: Ray 2.60, 2-core VM), a toy HSDP
  step a few ms. So the per-step path only does bookkeeping (two ``perf_counter`` calls and a
  few additions); the Ray metric objects are created once per process and written at most
  once per ``flush_every_s`` (Ray's exporter and Prometheus sample every 10-15 s anyway).
* Averages use counters (steps, step seconds, samples, collective seconds per dim) so that
  PromQL ``rate()`` gives honest means between any two scrapes; gauges carry the latest
  window for a glance.
* Metrics must never break training: a failing metric record or a node whose metrics
  endpoint does not answer gives ONE warning per process (at WARNING level on each node's
  local rank 0, DEBUG elsewhere) and the meter goes on timing without exporting.

What is and is not measured:

* step time: host wall time inside ``with meter.step()``. On CUDA the host may run ahead of
  the GPU, so a single step can look short or long; the window mean and the counters are
  right over many steps because the CUDA launch queue is bounded.
* time in collectives per mesh dim: only the collectives the train loop wraps in
  ``meter.collective(dim)``. On CPU (gloo) the wall time of the blocking call; on CUDA the
  time between two CUDA events recorded on the current stream around the call (the stream
  waits for the collective), read at flush time. Collectives issued inside FSDP2,
  tensor-parallel modules or pipelining are NOT seen: they overlap compute and measuring
  them needs the torch profiler. :func:`probe_dims` measures each dim's all-reduce latency
  and bus bandwidth directly instead.
* memory: process RSS (psutil) on every device, and torch.cuda allocated / reserved / peak
  bytes on CUDA devices.

Every metric carries the tags of :func:`mesh_tags`: run, rank, node_rank, node_ip and the
rank's mesh coordinate (pp, dp_replicate, dp_shard, cp, tp). Ray exports a metric named
``mesh_x`` as ``ray_mesh_x`` (Ray adds the ``ray_`` prefix; counters get ``_total``).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from ray_mesh.core import bootstrap
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS

logger = logging.getLogger(__name__)

TAG_KEYS: tuple[str, ...] = ("run", "rank", "node_rank", "node_ip", *DIM_NAMES)
DIM_TAG_KEYS: tuple[str, ...] = (*TAG_KEYS, "dim")
MESH_DIMS: tuple[str, ...] = (*DIM_NAMES, *FLATTENED_DIMS)


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: Ray name, kind, help text, and whether it has a ``dim`` tag."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    per_dim: bool = False

    @property
    def prometheus_name(self) -> str:
        """The series name on Ray's Prometheus endpoint."""
        return "ray_" + self.name + ("_total" if self.kind == "counter" else "")


METRICS: tuple[MetricDef, ...] = (
    MetricDef("mesh_step", "gauge", "Last finished training step (1-based)."),
    MetricDef("mesh_steps", "counter", "Training steps finished."),
    MetricDef("mesh_step_time_seconds", "counter", "Wall time spent inside steps."),
    MetricDef("mesh_step_seconds", "gauge", "Mean step wall time over the last window."),
    MetricDef("mesh_step_seconds_max", "gauge", "Slowest step in the last window."),
    MetricDef("mesh_samples", "counter", "Samples processed by this rank's steps."),
    MetricDef("mesh_tokens", "counter", "Tokens processed by this rank's steps."),
    MetricDef("mesh_samples_per_second", "gauge", "Samples/s over the last window."),
    MetricDef("mesh_tokens_per_second", "gauge", "Tokens/s over the last window."),
    MetricDef("mesh_loss", "gauge", "Loss of the last step that set one."),
    MetricDef("mesh_collective_seconds", "counter",
              "Time in collectives wrapped by meter.collective(dim).", per_dim=True),
    MetricDef("mesh_collective_calls", "counter",
              "Collectives wrapped by meter.collective(dim).", per_dim=True),
    MetricDef("mesh_collective_fraction", "gauge",
              "Share of the last window's step time spent in wrapped collectives.",
              per_dim=True),
    MetricDef("mesh_dim_allreduce_seconds", "gauge",
              "Median all-reduce time of probe_dims() on this dim.", per_dim=True),
    MetricDef("mesh_dim_busbw_bytes_per_second", "gauge",
              "All-reduce bus bandwidth of probe_dims() on this dim.", per_dim=True),
    MetricDef("mesh_process_rss_bytes", "gauge", "Resident memory of the worker process."),
    MetricDef("mesh_device_memory_allocated_bytes", "gauge",
              "torch.cuda.memory_allocated (CUDA only)."),
    MetricDef("mesh_device_memory_reserved_bytes", "gauge",
              "torch.cuda.memory_reserved (CUDA only)."),
    MetricDef("mesh_device_memory_peak_bytes", "gauge",
              "torch.cuda.max_memory_allocated (CUDA only)."),
)
METRICS_BY_NAME: dict[str, MetricDef] = {m.name: m for m in METRICS}
_STEP_KEYS = ("step", "step_time_s", "step_time_max_s", "samples_per_s", "tokens_per_s")


# ----------------------------------------------------------------------------- tags
def _train_context() -> Any | None:
    """Ray Train's context when this thread runs under Ray Train, else None."""
    try:
        import ray
        import ray.train

        if not ray.is_initialized():
            return None
        return ray.train.get_context()
    except Exception:  # noqa: BLE001 - not under Ray Train (torchrun, plain script)
        return None


def run_name() -> str:
    """Ray Train's run (experiment) name, else RAY_MESH_RUN, else 'local'."""
    ctx = _train_context()
    if ctx is not None:
        try:
            return str(ctx.get_experiment_name())
        except Exception:  # noqa: BLE001
            pass
    return os.environ.get("RAY_MESH_RUN", "local")


def mesh_tags(run: str | None = None) -> dict[str, str]:
    """The tags every ray_mesh metric carries for this process."""
    state = bootstrap.get_state() if bootstrap.is_initialized() else None
    ctx = _train_context()
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


# ----------------------------------------------------------------------------- export
class _Exporter:
    """Ray metric objects, created once per process; any failure disables export."""

    def __init__(self) -> None:
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.enabled = True
        self.warned = False
        self.checked_endpoint = False

    def warn_once(self, message: str, loud: bool) -> None:
        if self.warned:
            return
        self.warned = True
        (logger.warning if loud else logger.debug)("ray_mesh metrics: %s", message)

    def _metric(self, name: str) -> Any:
        metric = self._metrics.get(name)
        if metric is None:
            from ray.util.metrics import Counter, Gauge

            d = METRICS_BY_NAME[name]
            cls = Counter if d.kind == "counter" else Gauge
            metric = cls(d.name, description=d.help,
                         tag_keys=DIM_TAG_KEYS if d.per_dim else TAG_KEYS)
            self._metrics[name] = metric
        return metric

    def record(self, values: list[tuple[str, float, dict[str, str]]], loud: bool) -> None:
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
        except Exception as exc:  # noqa: BLE001 - metrics must never break training
            self.enabled = False
            self.warn_once(f"exporting to Ray's metrics failed ({type(exc).__name__}: {exc}); "
                           f"training goes on without ray_mesh metrics.", loud)


_EXPORTER = _Exporter()


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


def check_endpoint(timeout_s: float = 5.0, where: tuple[str, int] | None = None) -> str | None:
    """None when the Prometheus endpoint answers with Ray metrics, else why not.

    ``where`` is (ip, port); by default this process's node, as Ray reports it.
    """
    if where is None:
        try:
            where = metrics_endpoint()
        except Exception as exc:  # noqa: BLE001
            return f"cannot look up this node's metrics port ({type(exc).__name__}: {exc})"
    if where is None:
        return "Ray is not initialized in this process"
    ip, port = where
    if not port:
        return f"Ray reports no metrics export port for node {ip}"
    url = f"http://{ip}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - our node
            head = resp.read(1 << 20).decode("utf-8", "replace")
    except Exception as exc:  # noqa: BLE001
        return (f"Ray's metrics endpoint {url} does not answer ({type(exc).__name__}: {exc}). "
                f"The node's metrics agent is missing: install ray[default] on every node, "
                f"and give `ray start --metrics-export-port` a free port outside the worker "
                f"port range (10002-19999)")
    if "ray_" not in head:
        return (f"{url} answers but serves no Ray metrics: another process holds the port. "
                f"Restart Ray with a free --metrics-export-port")
    return None


def _check_endpoint_async(loud: bool) -> None:
    """Check the node's endpoint once per process, off the training thread."""
    if _EXPORTER.checked_endpoint:
        return
    _EXPORTER.checked_endpoint = True

    def run() -> None:
        problem = check_endpoint()
        if problem:
            _EXPORTER.warn_once(problem + "; training goes on, metrics will not reach "
                                "Prometheus or the dashboard.", loud)

    threading.Thread(target=run, name="ray_mesh-metrics-check", daemon=True).start()


# ----------------------------------------------------------------------------- meter
class _Collective:
    """Reusable timer for one dim (``with meter.collective(dim):``)."""

    __slots__ = ("_meter", "_dim", "_t0", "_ev0")

    def __init__(self, meter: StepMeter, dim: str) -> None:
        self._meter, self._dim = meter, dim
        self._t0 = 0.0
        self._ev0: Any = None

    def __enter__(self) -> _Collective:
        if self._meter._cuda:
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev0.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        m = self._meter
        if m._cuda:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record()
            m._pending_events.append((self._dim, self._ev0, ev1))
        else:
            m._coll_s[self._dim] = m._coll_s.get(self._dim, 0.0) + time.perf_counter() - self._t0
        m._coll_n[self._dim] = m._coll_n.get(self._dim, 0) + 1
        return False


class StepMeter:
    """Per-step timing, throughput, loss and collective time, exported with mesh tags.

    Args:
        samples_per_step: samples one step of THIS rank processes (default for
            ``step(samples=...)``); None leaves samples/s out.
        tokens_per_step: tokens one step of this rank processes; None leaves tokens/s out.
        run: run name for the ``run`` tag (default: Ray Train's experiment name).
        flush_every_s: how often the window is written to Ray's metrics.
        export: False keeps everything local (``summary()`` only).
        device: the device whose memory is reported (default: the mesh's device).
    """

    def __init__(
        self,
        *,
        samples_per_step: float | None = None,
        tokens_per_step: float | None = None,
        run: str | None = None,
        flush_every_s: float = 2.0,
        export: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        if flush_every_s <= 0:
            raise ValueError(f"flush_every_s must be > 0, got {flush_every_s}.")
        self.tags = mesh_tags(run)
        self._dim_tags: dict[str, dict[str, str]] = {}
        if device is None and bootstrap.is_initialized():
            device = bootstrap.get_state().device
        self.device = torch.device(device or "cpu")
        self._cuda = self.device.type == "cuda"
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self.flush_every_s = flush_every_s
        self._export = export and _train_context() is not None
        ctx = _train_context()
        self._loud = (ctx.get_local_rank() == 0) if ctx is not None else True
        self.loss: Any = None
        self.step_index = 0
        self._t0 = 0.0
        self._samples: float | None = None
        self._tokens: float | None = None
        self._coll: dict[str, _Collective] = {}
        self._pending_events: list[tuple[str, Any, Any]] = []
        self._probe: dict[str, tuple[float, float]] = {}
        self._reset_window(time.perf_counter())
        self._last: dict[str, float] = {}
        self._rss = None
        if export and not self._export:
            logger.info("ray_mesh metrics: not under Ray Train; metrics stay local "
                        "(StepMeter.summary()).")
        if self._export:
            _check_endpoint_async(self._loud)

    # -------------------------------------------------------------- per step (hot path)
    def step(self, samples: float | None = None, tokens: float | None = None) -> StepMeter:
        """``with meter.step(): ...`` times one step; set ``.loss`` inside the block."""
        self._samples = samples
        self._tokens = tokens
        return self

    def __enter__(self) -> StepMeter:
        self.loss = None
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.record_step(time.perf_counter() - self._t0, loss=self.loss,
                             samples=self._samples, tokens=self._tokens)
        return False

    def record_step(self, seconds: float, *, loss: Any = None, samples: float | None = None,
                    tokens: float | None = None) -> None:
        """Account one finished step of ``seconds`` (for loops that time steps themselves)."""
        self.step_index += 1
        self._w_steps += 1
        self._w_time += seconds
        if seconds > self._w_max:
            self._w_max = seconds
        s = self.samples_per_step if samples is None else samples
        if s is not None:
            self._w_samples += s
        t = self.tokens_per_step if tokens is None else tokens
        if t is not None:
            self._w_tokens += t
        if loss is not None:
            self._w_loss = loss  # a tensor is read at flush time: no device sync per step
        now = time.perf_counter()
        if now - self._w_start >= self.flush_every_s:
            self.flush(now)

    def collective(self, dim: str) -> _Collective:
        """``with meter.collective('dp'):`` times a collective this loop issues on ``dim``."""
        timer = self._coll.get(dim)
        if timer is None:
            if dim not in MESH_DIMS:
                raise ValueError(f"Unknown mesh dim {dim!r}: use one of {MESH_DIMS}.")
            timer = self._coll[dim] = _Collective(self, dim)
        return timer

    # -------------------------------------------------------------- window
    def _reset_window(self, now: float) -> None:
        self._w_start = now
        self._w_steps = 0
        self._w_time = 0.0
        self._w_max = 0.0
        self._w_samples = 0.0
        self._w_tokens = 0.0
        self._w_loss: Any = None
        self._coll_s: dict[str, float] = {}
        self._coll_n: dict[str, int] = {}

    def _tags_for(self, dim: str) -> dict[str, str]:
        tags = self._dim_tags.get(dim)
        if tags is None:
            tags = self._dim_tags[dim] = {**self.tags, "dim": dim}
        return tags

    def flush(self, now: float | None = None) -> dict[str, float]:
        """Close the current window: compute its numbers, export them, start a new one."""
        now = time.perf_counter() if now is None else now
        for dim, ev0, ev1 in self._pending_events:
            ev1.synchronize()
            self._coll_s[dim] = self._coll_s.get(dim, 0.0) + ev0.elapsed_time(ev1) / 1e3
        self._pending_events.clear()
        wall = max(now - self._w_start, 1e-9)
        # A window without steps keeps the last step numbers (summary() stays useful); only
        # windows with steps are exported for them, so rates are not diluted by idle gaps.
        out: dict[str, float] = {} if self._w_steps else {
            k: v for k, v in self._last.items() if k in _STEP_KEYS}
        tags = self.tags
        rec: list[tuple[str, float, dict[str, str]]] = []
        if self._w_steps:
            out["step"] = self.step_index
            out["step_time_s"] = self._w_time / self._w_steps
            out["step_time_max_s"] = self._w_max
            rec += [("mesh_step", self.step_index, tags),
                    ("mesh_steps", self._w_steps, tags),
                    ("mesh_step_time_seconds", self._w_time, tags),
                    ("mesh_step_seconds", out["step_time_s"], tags),
                    ("mesh_step_seconds_max", self._w_max, tags)]
            if self._w_samples:
                out["samples_per_s"] = self._w_samples / wall
                rec += [("mesh_samples", self._w_samples, tags),
                        ("mesh_samples_per_second", out["samples_per_s"], tags)]
            if self._w_tokens:
                out["tokens_per_s"] = self._w_tokens / wall
                rec += [("mesh_tokens", self._w_tokens, tags),
                        ("mesh_tokens_per_second", out["tokens_per_s"], tags)]
        if self._w_loss is not None:
            loss = float(self._w_loss.detach().float().item()
                         if isinstance(self._w_loss, torch.Tensor) else self._w_loss)
            if math.isfinite(loss):
                out["loss"] = loss
                rec.append(("mesh_loss", loss, tags))
        for dim, secs in self._coll_s.items():
            dt = self._tags_for(dim)
            out[f"collective_s/{dim}"] = secs
            rec += [("mesh_collective_seconds", secs, dt),
                    ("mesh_collective_calls", self._coll_n.get(dim, 0), dt)]
            if self._w_time:
                out[f"collective_fraction/{dim}"] = secs / self._w_time
                rec.append(("mesh_collective_fraction", secs / self._w_time, dt))
        rec += self._memory(out)
        rec += self._probe_records()  # gauges expire on Ray's side unless set again
        self._last = out
        if self._export:
            _EXPORTER.record(rec, self._loud)
        self._reset_window(now)
        return out

    def _memory(self, out: dict[str, float]) -> list[tuple[str, float, dict[str, str]]]:
        rec = []
        try:
            if self._rss is None:
                import psutil

                self._rss = psutil.Process()
            out["rss_bytes"] = float(self._rss.memory_info().rss)
            rec.append(("mesh_process_rss_bytes", out["rss_bytes"], self.tags))
        except Exception:  # noqa: BLE001 - memory is best effort
            pass
        if self._cuda:
            out["device_allocated_bytes"] = float(torch.cuda.memory_allocated(self.device))
            out["device_reserved_bytes"] = float(torch.cuda.memory_reserved(self.device))
            out["device_peak_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
            rec += [("mesh_device_memory_allocated_bytes", out["device_allocated_bytes"],
                     self.tags),
                    ("mesh_device_memory_reserved_bytes", out["device_reserved_bytes"],
                     self.tags),
                    ("mesh_device_memory_peak_bytes", out["device_peak_bytes"], self.tags)]
        return rec

    def summary(self) -> dict[str, float]:
        """The last flushed window's numbers, ready for ``ray.train.report``."""
        return dict(self._last)

    def close(self) -> dict[str, float]:
        """Flush what is left (call at the end of training)."""
        return self.flush()

    def record_probe(self, results: dict[str, tuple[float, float]]) -> None:
        """Export :func:`probe_dims` results (dim -> (seconds, bus bytes/s)).

        They are written again at every flush: Ray drops a gauge that is not refreshed
        within two export intervals (~20 s), and a probe runs once.
        """
        self._probe.update(results)
        if self._export:
            _EXPORTER.record(self._probe_records(), self._loud)

    def _probe_records(self) -> list[tuple[str, float, dict[str, str]]]:
        rec = []
        for dim, (secs, busbw) in self._probe.items():
            rec += [("mesh_dim_allreduce_seconds", secs, self._tags_for(dim)),
                    ("mesh_dim_busbw_bytes_per_second", busbw, self._tags_for(dim))]
        return rec


# ----------------------------------------------------------------------------- probe
def probe_dims(
    dims: tuple[str, ...] | None = None,
    nbytes: int = 1 << 20,
    iters: int = 5,
    meter: StepMeter | None = None,
) -> dict[str, tuple[float, float]]:
    """Time an all-reduce of ``nbytes`` on every mesh dim of size > 1 (all ranks must call).

    Returns dim -> (median seconds, bus bandwidth in bytes/s, nccl-tests' definition
    ``nbytes * 2 (n-1) / n / t``), and exports them through ``meter`` when given. A direct
    measure of each dim's link, for the collectives that :class:`StepMeter` cannot see.
    """
    import torch.distributed as dist

    state = bootstrap.get_state()
    mesh = state.mesh
    dims = dims or tuple(d for d in MESH_DIMS if bootstrap.submesh(mesh, d).size() > 1)
    numel = max(1, nbytes // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=state.device)
    results: dict[str, tuple[float, float]] = {}
    for dim in dims:
        n = bootstrap.submesh(mesh, dim).size()
        if n < 2:
            continue
        group = mesh.get_group(dim)
        dist.all_reduce(buf, group=group)  # warm-up: connection setup is not the link
        times = []
        for _ in range(iters):
            if state.device.type == "cuda":
                torch.cuda.synchronize(state.device)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if state.device.type == "cuda":
                torch.cuda.synchronize(state.device)
            times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        results[dim] = (med, numel * 4 * 2 * (n - 1) / n / med)
    if meter is not None:
        meter.record_probe(results)
    return results


__all__ = ["METRICS", "MetricDef", "StepMeter", "check_endpoint", "mesh_tags", "probe_dims",
           "run_name"]
