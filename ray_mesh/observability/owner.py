"""One owner for a worker's observability: the report recorder, the hang watch, the wait sampler.

One :class:`Observability` per run and process holds them all, so that a second run in the
same process starts from nothing the first left (a recorder still counting its reports, a
progress clock still holding its first step):

* ``start(mesh)`` creates them in order: the metrics exporter and the report recorder
  first (they need nothing), then the hang watch (it bounds the mesh's groups), then the
  wait sampler (it samples the training thread and exports through the exporter);
* ``train_thread()`` is the training thread's part: the sampler watches that thread, and
  the recorder (fed by ``ray_mesh.report``) saves the run's summary at its end;
* ``stop()`` stops them in reverse order and forgets the owner; ``start`` after ``stop``
  builds everything afresh.

Under Ray Train the worker's bring-up (``raytrain.worker_setup``) starts it after the mesh and
stops it before the mesh is destroyed. Under torchrun, :func:`watch_mesh` runs one with the
hang watch alone. :mod:`ray_mesh.observability.active` holds the one pointer to the running
owner, cleared by ``stop``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ray_mesh.core.options import MeshOptions
from ray_mesh.errors import CollectiveHangError
from ray_mesh.observability import active, progress
from ray_mesh.observability.export import Exporter, WindowExporter
from ray_mesh.observability.hang import HangWatch, mesh_groups, start_watch
from ray_mesh.observability.report import ReportRecorder, recording
from ray_mesh.observability.waits import DEFAULT_INTERVAL_S, WaitSampler

logger = logging.getLogger(__name__)


def _watch_off() -> MeshOptions:
    """The options an owner built without a run's has: no hang watch (under torchrun it is
    asked for with :func:`watch_mesh`), the wait sampler at its default interval."""
    return MeshOptions(hang_timeout_s=None, wait_sample_s=DEFAULT_INTERVAL_S)


@dataclass(frozen=True)
class ObservabilitySettings:
    """What a run observes: the run's options whole, and what only the bring-up knows.

    Attributes:
        options: the run's :class:`~ray_mesh.core.options.MeshOptions`; the owner reads
            ``hang_timeout_s`` (the hang watch, ``observability.hang``) and ``wait_sample_s``
            (the wait sampler, ``observability.waits``) there; None turns a part off.
        pg_timeout_s: the process-group timeout, an upper bound for the watched groups'.
        links: the measured link matrix, exported with the wait windows (rank 0 passes it).
        total_steps: the run's step count, for the progress line's ``/N`` and ETA.
        export: write metrics to Ray's pipeline (inside Ray Train only).
    """

    options: MeshOptions = field(default_factory=_watch_off)
    pg_timeout_s: float | None = None
    links: list[dict[str, Any]] | None = None
    total_steps: int | None = None
    export: bool = True


class Observability:
    """This process's observability for one run; see the module docstring."""

    def __init__(self, settings: ObservabilitySettings | None = None) -> None:
        self.settings = settings or ObservabilitySettings()
        self.exporter: Exporter | None = None
        self.recorder: ReportRecorder | None = None
        self.watch: HangWatch | None = None
        self.sampler: WaitSampler | None = None
        self.running = False

    # ------------------------------------------------------------------ start / stop
    def start(self, mesh: Any, *, rank: int | None = None, device: Any = None
              ) -> Observability:
        """Start recorder, watch and sampler, in that order (stopping an owner left running).

        A hang watch or wait sampler that cannot start only warns: they are diagnosis aids,
        not a reason to fail a run that has its mesh."""
        left = active.current()
        if left is not None and left is not self:
            left.stop()
        if self.running:
            self.stop()
        s = self.settings
        rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
        loud = os.environ.get("LOCAL_RANK", "0") == "0"
        self.exporter = Exporter(loud) if s.export else None
        if self.exporter is not None:
            self.exporter.check_endpoint_async()
        self.recorder = ReportRecorder(self.exporter, total_steps=s.total_steps, device=device,
                                       show=progress.show if rank == 0 else None)
        if s.options.hang_timeout_s:
            self.watch = _try("the hang watch", "a hung collective is reported only by the "
                              "process-group timeout. MeshConfig(hang_timeout_s=None)",
                              lambda: start_watch(mesh, s.options.hang_timeout_s,
                                                  pg_timeout_s=s.pg_timeout_s))
        if s.options.wait_sample_s:
            window = WindowExporter(self.exporter, s.links) if self.exporter else None
            self.sampler = _try("the wait sampler", "no per-dim wait metrics. "
                                "MeshConfig(wait_sample_s=None)",
                                lambda: WaitSampler(mesh_groups(mesh), window,
                                                    interval_s=s.options.wait_sample_s).start())
        self.running = True
        active.install(self)
        return self

    def stop(self) -> None:
        """Stop sampler, watch, recorder: the reverse of :meth:`start`. Twice is harmless."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.watch is not None:
            self.watch.stop()
        if self.recorder is not None and self.running:
            self.recorder.flush()
        if self.exporter is not None:
            self.exporter.close()
        self.sampler = self.watch = None
        self.running = False
        active.clear(self)

    def __enter__(self) -> Observability:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.stop()
        return False

    # ------------------------------------------------------------------ training thread
    @contextmanager
    def train_thread(self) -> Iterator[None]:
        """Entered in the training thread for the train function: the sampler samples this
        thread only; at its end the recorder saves the run's summary (``report.recording``;
        ``ray_mesh.report`` feeds the recorder)."""
        if self.sampler is not None:
            self.sampler.watch_thread()
        if self.recorder is None:
            yield
            return
        with recording(self.recorder):
            yield

    def explain(self, exc: BaseException | None) -> CollectiveHangError | None:
        """The CollectiveHangError to raise instead of ``exc``, if this rank saw a hang."""
        return self.watch.explain(exc) if self.watch is not None else None


def _try(what: str, without: str, start: Any) -> Any:
    try:
        return start()
    except Exception as exc:  # noqa: BLE001 - a diagnosis aid must not fail the run
        message = (f"ray_mesh: {what} could not start ({type(exc).__name__}: {exc}); training "
                   f"goes on, but {without} silences this.")
        logger.warning("%s", message)
        print(message, file=sys.stderr, flush=True)
        return None


@contextmanager
def watch_mesh(mesh: Any, timeout_s: float, **kwargs: Any) -> Iterator[HangWatch]:
    """``with watch_mesh(mesh, 60): train()`` under torchrun: errors of a hung collective
    become a :class:`CollectiveHangError` with the report. ``kwargs``: ``start_watch``'s.

    Stability: experimental
    """
    obs = Observability(ObservabilitySettings(
        MeshOptions(hang_timeout_s=None, wait_sample_s=None), export=False))
    obs.start(mesh)  # an owner with no watch yet: the recorder only, never exported
    obs.watch = start_watch(mesh, timeout_s, **kwargs)  # raises: torchrun asked for it
    try:
        yield obs.watch
    except BaseException as exc:
        better = obs.explain(exc)
        if better is not None:
            raise better from None  # the report names the collective; gloo's text adds nothing
        raise
    finally:
        obs.stop()


__all__ = ["watch_mesh"]
