"""Every number a train function reports becomes a metric, a progress line and the run's
summary: :func:`report` is ``ray.train.report`` plus that.

A step is reported with ``ray_mesh.report(metrics)`` on every rank (same arguments as
``ray.train.report``, which it calls), or with :func:`report_progress`, which is
:func:`report` under Ray Train and a progress line printed on rank 0 under torchrun. Each
dict goes to this process's :class:`ReportRecorder`, the running observability owner's
(``observability.active``), then to Ray Train. Why a call of ours rather than a wrapper
around Ray's: a replaced ``ray.train.report`` misses every name bound before it was
replaced (``from ray.train import report``) and changes a library function under code that
did not ask for it; an explicit call is seen wherever it is bound and says what it does.

What the recorder takes from a report (all optional):

* ``step``: the step count; steps/s and the time per step come from the recorder's clock
  between reports (without ``step``, one report counts as one step);
* ``samples``, ``tokens``: counts so far (they grow like ``step``): samples/s and tokens/s;
* ``loss`` and any other number: shown on the progress line and exported as is.

Per report only bookkeeping is done (and rank 0's progress line); the Ray metric objects are
written at most every ``FLUSH_EVERY_S`` (Ray exports every ~10 s anyway; one Ray metric write
costs 10-20 us). Exported, with the tags of ``export.mesh_tags`` (run, rank, node, mesh
coordinate): the series of ``export.METRICS`` that reports feed (``mesh_step``,
``mesh_step_seconds``, ``mesh_samples_per_second``, ``mesh_loss``, process memory, ...), and
``mesh_report_<key>`` (a gauge per numeric key) with ``mesh_report_step_seconds`` and
``mesh_report_steps_per_second``. A failing metrics pipeline warns once and training goes on.
A report costs Ray Train a wait for the controller's poll (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``;
``ray-mesh run`` sets it low), so report every N steps, not every step.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ray_mesh.errors import ConfigurationError
from ray_mesh.observability import active
from ray_mesh.observability.export import Exporter, mesh_tags, run_name
from ray_mesh.observability.progress import carried_rates, progress_line

logger = logging.getLogger(__name__)

FLUSH_EVERY_S = 2.0
LINE_EVERY_S = 1.0
LINE_EVERY_STEPS = 10
PREFIX = "mesh_report_"
DERIVED = ("step_seconds", "steps_per_second")
_COUNTED = (("samples", "samples_per_s"), ("tokens", "tokens_per_s"))


def metric_name(key: str) -> str:
    """``mesh_report_<key>`` with every character Prometheus refuses turned into ``_``."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def numeric_items(metrics: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """The finite numbers of ``metrics`` (bools, strings, tensors of >1 element left out)."""
    for key, value in metrics.items():
        if isinstance(value, bool):
            continue
        if not isinstance(value, int | float):
            if getattr(value, "numel", lambda: 0)() != 1:  # a one-element tensor counts
                continue
            value = value.item()
        value = float(value)
        if math.isfinite(value):
            yield key, value


class ReportRecorder:
    """The reports of one run in this process: numbers, rates, progress line, metrics.

    Args:
        exporter: where the metrics go (None: nowhere, e.g. in tests).
        name: the run's name, first on the progress line (None: Ray Train's experiment
            name, read at the first report, in the training thread).
        total_steps: the run's step count, for ``step i/N`` and the ETA (None: unknown).
        show: called with each progress line (world rank 0 passes ``progress.show``).
        flush_every_s: how often the window is written to the exporter.
        clock: the time source (``time.perf_counter``).
    """

    def __init__(self, exporter: Exporter | None = None, *, name: str | None = None,
                 total_steps: int | None = None, show: Callable[[str], None] | None = None,
                 flush_every_s: float = FLUSH_EVERY_S,
                 clock: Callable[[], float] = time.perf_counter,
                 device: Any = None) -> None:
        self.exporter, self.name, self.total_steps = exporter, name, total_steps
        self.show, self.flush_every_s, self.clock, self.device = show, flush_every_s, clock, device
        self.latest: dict[str, Any] = {}
        self.calls = 0
        self.rates: dict[str, float] = {}  # since the first report: the summary's and ETA's
        self.derived: dict[str, float] = {}  # of the last window
        self.first_t: float | None = None  # when the first report came
        self.last_t = 0.0
        self._first: dict[str, float] = {}  # the counters at the first report
        self._prev: dict[str, float] = {}  # the counters at the previous report
        self._w_start = 0.0
        self._w: dict[str, float] = {}  # the window's increments: step, samples, tokens
        self._tags: dict[str, str] | None = None
        self._rss: Any = None
        self._shown: tuple[float, float] | None = None  # (time, step) of the last line

    # ------------------------------------------------------------------ per report
    def observe(self, metrics: dict[str, Any]) -> None:
        """One report: keep the numbers, count, show rank 0's line, flush a full window."""
        now = self.clock()
        self.calls += 1
        self.latest.update(metrics)
        numbers = dict(numeric_items(metrics))
        counters = {"step": numbers.get("step", float(self.calls))}
        counters.update({k: numbers[k] for k, _ in _COUNTED if k in numbers})
        before = self._prev.get("step")
        gap = counters["step"] - before if before is not None else None
        if self.first_t is None:
            self.first_t, self._w_start, self._first = now, now, dict(counters)
            # no interval of its own yet: the rates the report carries, if any (a loop that
            # times itself; a group that rejoined late may report only once)
            self.rates = carried_rates(numbers)
        else:
            for key, value in counters.items():
                before = self._prev.get(key)
                if before is not None and value > before:
                    self._w[key] = self._w.get(key, 0.0) + value - before
            self.rates = self._rates(counters, now - self.first_t)
        self._prev.update(counters)
        self.last_t = now
        if self.show is not None and self._line_due(counters["step"], gap, now):
            if self.name is None:
                self.name = run_name()
            try:
                self.show(progress_line(self.name, counters["step"], self.total_steps,
                                        numbers, self.rates))
            except Exception:  # noqa: BLE001 - a progress line must never break a report
                logger.debug("ray_mesh: no progress line", exc_info=True)
        if now - self._w_start >= self.flush_every_s:
            self.flush(now)

    def _line_due(self, step: float, gap: float | None, now: float) -> bool:
        """A line for every report of a loop that reports every few steps (``gap``: steps
        since the previous report, > 1); for one that reports every step, a line only
        ``LINE_EVERY_STEPS`` steps or ``LINE_EVERY_S`` seconds after the last one shown, and
        for the first and the last report: the console is not filled step by step."""
        last = self.total_steps is not None and step >= self.total_steps
        if (self._shown is not None and not last and (gap is None or gap <= 1)
                and now - self._shown[0] < LINE_EVERY_S
                and step - self._shown[1] < LINE_EVERY_STEPS):
            return False
        self._shown = (now, step)
        return True

    def _rates(self, counters: dict[str, float], elapsed: float) -> dict[str, float]:
        if elapsed <= 0:
            return self.rates
        out = {"steps_per_s": (counters["step"] - self._first["step"]) / elapsed}
        for key, rate in _COUNTED:
            if key in counters and key in self._first:
                out[rate] = (counters[key] - self._first[key]) / elapsed
        return out if out["steps_per_s"] > 0 else self.rates

    # ------------------------------------------------------------------ window
    def flush(self, now: float | None = None) -> dict[str, float]:
        """Close the window: derive step time and rate, export every number."""
        now = self.clock() if now is None else now
        wall, steps = now - self._w_start, self._w.get("step", 0.0)
        if steps and wall > 0:
            self.derived = {"step_seconds": wall / steps, "steps_per_second": steps / wall}
        values = {**dict(numeric_items(self.latest)), **self.derived}
        if self.exporter is not None and self.exporter.enabled:
            self._export(values, wall)
        self._w_start, self._w = now, {}
        return values

    def _export(self, values: dict[str, float], wall: float) -> None:
        if self._tags is None or self._tags.get("run") == "local":
            self._tags = mesh_tags()
        tags, w = self._tags, self._w
        rec: list[tuple[str, float, dict[str, str]]] = []
        if "step" in values:
            rec.append(("mesh_step", values["step"], tags))
        if "loss" in values:
            rec.append(("mesh_loss", values["loss"], tags))
        if w.get("step") and wall > 0:
            rec += [("mesh_steps", w["step"], tags), ("mesh_step_time_seconds", wall, tags),
                    ("mesh_step_seconds", self.derived["step_seconds"], tags)]
        for key, unit in (("samples", "mesh_samples"), ("tokens", "mesh_tokens")):
            if w.get(key) and wall > 0:
                rec += [(unit, w[key], tags), (unit + "_per_second", w[key] / wall, tags)]
        rec += self._memory(tags)
        self.exporter.record(rec)
        for key, value in values.items():
            self.exporter.gauge(metric_name(key), value, tags, f"Last reported {key!r}.")

    def _memory(self, tags: dict[str, str]) -> list[tuple[str, float, dict[str, str]]]:
        rec = []
        try:
            if self._rss is None:
                import psutil

                self._rss = psutil.Process()
            rec.append(("mesh_process_rss_bytes", float(self._rss.memory_info().rss), tags))
        except Exception:  # noqa: BLE001 - memory is best effort
            pass
        if self.device is not None and getattr(self.device, "type", "") == "cuda":
            import torch

            rec += [("mesh_device_memory_allocated_bytes",
                     float(torch.cuda.memory_allocated(self.device)), tags),
                    ("mesh_device_memory_reserved_bytes",
                     float(torch.cuda.memory_reserved(self.device)), tags),
                    ("mesh_device_memory_peak_bytes",
                     float(torch.cuda.max_memory_allocated(self.device)), tags)]
        return rec

    def summary(self) -> dict[str, Any]:
        """What the run's summary needs: the last numbers with the run's rates (steps/s,
        samples/s, tokens/s from the first report to the last), reports and their span, and
        when it was made (``saved_at``, wall clock): a run resumed at its last step reports
        nothing and leaves the previous run's summary, which the driver must not take for
        this run's."""
        out: dict[str, Any] = {"reports": self.calls, "saved_at": time.time(),
                               "last": {**dict(numeric_items(self.latest)), **self.rates}}
        if self.first_t is not None:
            out["report_seconds"] = self.last_t - self.first_t
        return out


def report(metrics: dict[str, Any], checkpoint: Any = None, **kwargs: Any) -> None:
    """Report a step: ``ray.train.report(metrics, checkpoint, **kwargs)``, and ray_mesh's
    progress line, metrics and run summary from the numbers in ``metrics``.

    Call it on every rank where you would call ``ray.train.report`` (same arguments, same
    wait for Ray Train's controller). A plain ``ray.train.report`` still works and still
    saves checkpoints, but ray_mesh sees nothing of it: no progress line, no
    ``ray_mesh_report_*`` series, no summary. Outside Ray Train there is no Ray report to
    make: use :func:`report_progress`, which serves both launchers.

    Stability: experimental
    """
    from ray_mesh.core.runtime import in_ray_train

    if not in_ray_train():
        raise ConfigurationError(
            "ray_mesh.report() runs inside a Ray Train worker (a TorchTrainer's train "
            "function); here there is no Ray Train run to report to. Under torchrun call "
            "ray_mesh.report_progress(name, metrics, total_steps), which prints the progress "
            "line on rank 0 there and reports through Ray Train under Ray.")
    _to_ray_train(metrics, checkpoint, **kwargs)


def _to_ray_train(metrics: dict[str, Any], checkpoint: Any = None, **kwargs: Any) -> None:
    """The recorder first, then Ray Train's report; the caller knows it is in Ray Train."""
    import ray.train

    record(metrics)
    ray.train.report(metrics, checkpoint=checkpoint, **kwargs)


def record(metrics: dict[str, Any]) -> None:
    """Hand ``metrics`` to the running owner's recorder, if any; never raises (recording
    must never break a report)."""
    recorder = getattr(active.current(), "recorder", None)
    if recorder is None:
        return
    try:
        recorder.observe(metrics)
    except Exception:  # noqa: BLE001 - recording must never break a report
        logger.debug("ray_mesh: could not record reported metrics", exc_info=True)


def report_progress(name: str, metrics: dict[str, float], total_steps: int | None = None
                    ) -> None:
    """Report ``metrics`` the way the run was started; call it on every rank.

    Under Ray Train: :func:`report` (``ray.train.report`` and ray_mesh's recorder: the
    progress line on the driver, the exported numbers, the run's summary). Under torchrun
    (no Ray Train) world rank 0 prints the same line itself. So one train function serves
    both launchers (the examples are run either way).

    Stability: experimental
    """
    from ray_mesh.core.runtime import in_ray_train

    if in_ray_train():
        _to_ray_train(metrics)
        return
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(progress_line(name, metrics.get("step", 0), total_steps, metrics,
                            carried_rates(metrics)),
              flush=True)


def report_due(step: int, steps: int, every: int) -> bool:
    """Whether 0-based ``step`` of ``steps`` reports: the first, every ``every``-th and the
    last (the same answer on every rank, so every rank reports together).

    Stability: experimental
    """
    return step == 0 or (step + 1) % every == 0 or step + 1 == steps


@contextmanager
def recording(recorder: ReportRecorder) -> Iterator[None]:
    """For the duration of the train function: at its end the last window is flushed and
    rank 0 saves the summary (:func:`save_summary`). Reports reach ``recorder`` through
    :func:`report` (the running owner's), never by replacing Ray's function."""
    try:
        yield
    finally:
        recorder.flush()
        save_summary(recorder)


SUMMARY_FILE = "ray_mesh_summary.json"


def save_summary(recorder: ReportRecorder) -> None:
    """On rank 0 at the end of the train function: the recorder's summary into the run
    directory (through Ray Train's storage filesystem, as the layout is), for the driver's
    final summary: Ray Train keeps a report's metrics in ``Result`` only when the report
    carried a checkpoint (upstream: ray-train-result-metrics-need-checkpoint). Never raises."""
    if not recorder.calls:  # nothing reported (or not through ray_mesh.report)
        return
    try:
        import json

        import ray.train

        ctx = ray.train.get_context()
        if ctx.get_world_rank() != 0:
            return
        storage = ctx.get_storage()
        fs, run_dir = storage.storage_filesystem, storage.experiment_fs_path
        fs.create_dir(run_dir, recursive=True)
        with fs.open_output_stream(f"{run_dir}/{SUMMARY_FILE}") as out:
            out.write(json.dumps(recorder.summary()).encode())
    except Exception as exc:  # noqa: BLE001 - a summary must not fail a finished run
        logger.debug("ray_mesh: could not save the run summary: %s", exc)


SUMMARY_MAX_BYTES = 4 * 2**20


def read_summary(run_path: str, timeout_s: float = 30.0,
                 filesystem: Any = None) -> dict[str, Any]:
    """The summary rank 0 saved under ``run_path`` (a local path or URI, or a path in
    ``filesystem``: Ray's ``Result.filesystem``, e.g. a bucket at an endpoint), or {}.

    Bounded (size and time: the storage may be slow) and checked: a file that is not a JSON
    object, or a ``last`` that is not one, reads as {}. The caller escapes what it prints.
    """
    try:
        import json

        from ray_mesh.observability.fetch import read_storage_file

        data = read_storage_file(run_path, SUMMARY_FILE, timeout_s=timeout_s,
                                 max_bytes=SUMMARY_MAX_BYTES, what=SUMMARY_FILE,
                                 filesystem=filesystem)
        doc = json.loads(data.decode()) if data else {}
    except Exception:  # noqa: BLE001 - not written (a failed run), or storage not reachable
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("last", {}), dict):
        return {}
    return doc


CLOCK_SKEW_S = 5.0
"""Slack for rank 0's clock behind the driver's: its summary is saved at the end of the fit,
after Ray Train's start-up (10 s or more), so a fresh one is seen as fresh with clocks that
far apart too. A rerun started within this of the previous run's summary may wait for a line
that never comes (at most ``console_tail.TAIL_WAIT_S``)."""


def last_report(result: Any, since: float | None = None) -> tuple[dict[str, Any], bool]:
    """Rank 0's last report in a Ray Train ``Result``, and whether it was made by this fit
    (started at wall time ``since``). Ray Train keeps a report's metrics in ``Result`` only
    with a checkpoint, so the summary rank 0 saved fills in
    (upstream: ray-train-result-metrics-need-checkpoint).
    A run resumed at its last step reports nothing: the summary and the checkpoint's metrics
    are the previous fit's, whose progress lines will never reach this console. A summary
    without ``saved_at`` (an older ray_mesh) counts as this fit's; rank 0's clock may be
    another machine's, hence the :data:`CLOCK_SKEW_S` of slack."""
    saved = read_summary(str(result.path), filesystem=getattr(result, "filesystem", None)) \
        if result.path else {}
    at = saved.get("saved_at")
    fresh = since is None or not isinstance(at, int | float) or at >= since - CLOCK_SKEW_S
    return {**saved.get("last", {}), **dict(result.metrics or {})}, fresh


__all__ = ["report", "report_due", "report_progress"]
