"""The per-step meter of a training loop: timing, throughput, loss, collective time.

The hot path only does bookkeeping (two ``perf_counter`` calls and a few additions); once
per ``flush_every_s`` a window's numbers are computed and handed to the exporter
(``ray_mesh.observability.export``). See ``ray_mesh.observability.metrics`` for what is and
is not measured.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ray_mesh.core import bootstrap
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS
from ray_mesh.observability.export import EXPORTER, check_endpoint_async, mesh_tags, train_context

logger = logging.getLogger(__name__)

MESH_DIMS: tuple[str, ...] = (*DIM_NAMES, *FLATTENED_DIMS)
_STEP_KEYS = ("step", "step_time_s", "step_time_max_s", "samples_per_s", "tokens_per_s")


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
        self._export = export and train_context() is not None
        ctx = train_context()
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
            check_endpoint_async(self._loud)

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
            EXPORTER.record(rec, self._loud)
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
            EXPORTER.record(self._probe_records(), self._loud)

    def _probe_records(self) -> list[tuple[str, float, dict[str, str]]]:
        rec = []
        for dim, (secs, busbw) in self._probe.items():
            rec += [("mesh_dim_allreduce_seconds", secs, self._tags_for(dim)),
                    ("mesh_dim_busbw_bytes_per_second", busbw, self._tags_for(dim))]
        return rec


__all__ = ["MESH_DIMS", "StepMeter"]
