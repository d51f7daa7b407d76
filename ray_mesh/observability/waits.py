"""Per mesh dim, how long this rank waits in collectives: a sampler, no user code (torch only).

What a straggler or a slow link looks like from inside a rank is *where its time goes*: a
rank that waits on a slow peer sits in that dim's collective, the slow rank itself hardly
waits, and a slow link keeps every rank of the dims that cross it waiting. So each rank
measures, per window, the seconds its training thread spent blocked in each dim's
collectives and the rest (compute, data, Python): :mod:`ray_mesh.observability.slow`
compares the ranks.

Why a sampler and not a timer around each collective:

* **It sees every collective without wrapping anything.** FSDP2, tensor parallel
  (functional collectives) and user code issue collectives through different paths, many
  asynchronously (the wait is a later ``work.wait()``), so a timer around
  ``dist.all_reduce`` would miss most of them, and wrapping torch's functions is fragile.
  The training thread's innermost Python frame says it all: inside ``distributed_c10d`` the
  ``group`` local names the process group; on a ``.wait(`` line or inside
  ``_functional_collectives`` the group is the one whose collective count (torch's
  per-group sequence number, as in :mod:`ray_mesh.observability.hang`) moved last.
* **It costs the training thread nothing per step**: no code on its path. The sampler
  thread wakes every ``interval_s`` (20 ms), reads one frame and one counter per group,
  a few microseconds under the GIL (``benchmarks/slow.py`` measures the step cost).

It is statistical: a window of 5 s holds 250 samples, so a wait share is good to a few %;
a collective shorter than the interval is seen in proportion to its length. A frame that
is only *in* torch.distributed Python code (FSDP's copy-in, say) without waiting is not
counted unless it is on a ``.wait(`` line.
"""

from __future__ import annotations

import linecache
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import ray_mesh.private_apis as private_apis

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.02
DEFAULT_WINDOW_S = 5.0
_C10D = f"torch{os.sep}distributed{os.sep}distributed_c10d.py"
_FUNCOL = f"torch{os.sep}distributed{os.sep}_functional_collectives.py"
_DIST = f"torch{os.sep}distributed{os.sep}"
_GROUP_LOCALS = ("group", "pg", "process_group")

Window = dict[str, Any]  # {"window_s", "wait_s": {label: s}, "compute_s", "samples"}


class WaitSampler:
    """Samples the training thread; hands a :data:`Window` to ``on_window`` every window.

    Args:
        groups: ``{label: group}`` as :func:`ray_mesh.observability.hang.mesh_groups` gives.
        on_window: called in the sampler thread with each finished window (exceptions are
            logged once and the sampler goes on).
        interval_s: time between samples.
        window_s: length of a window.
    """

    def __init__(self, groups: dict[str, dist.ProcessGroup],
                 on_window: Callable[[Window], None] | None = None, *,
                 interval_s: float = DEFAULT_INTERVAL_S,
                 window_s: float = DEFAULT_WINDOW_S) -> None:
        if not interval_s or not 0 < interval_s <= 1:
            raise ValueError(f"wait_sample_s must be in (0, 1] seconds (or None to turn the "
                             f"wait sampler off), got {interval_s!r}.")
        if window_s < 10 * interval_s:
            raise ValueError(f"window_s={window_s!r} must hold at least 10 samples of "
                             f"{interval_s} s.")
        self.groups = dict(groups)
        self._by_name = {g.group_name: label for label, g in self.groups.items()}
        self.on_window = on_window
        self.interval_s, self.window_s = float(interval_s), float(window_s)
        self.thread_id: int | None = None  # the training thread, once known
        self.last: Window | None = None
        self._seq: dict[str, int] = {}
        self._moved: dict[str, float] = {}
        self._callback_failed = False
        self._stop = threading.Event()
        self._reset(time.perf_counter())
        self._thread = threading.Thread(target=self._loop, name="ray_mesh-wait-sampler",
                                        daemon=True)

    # ------------------------------------------------------------------ control
    def start(self) -> WaitSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def watch_thread(self, ident: int | None = None) -> None:
        """Sample only this thread (the training thread); default: the caller."""
        self.thread_id = threading.get_ident() if ident is None else ident

    # ------------------------------------------------------------------ sampling
    def _reset(self, now: float) -> None:
        self._w_start = self._last_t = now
        self._w_total = 0.0
        self._w_wait: dict[str, float] = {}
        self._w_any = 0.0
        self._w_samples = 0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - the sampler must never break training
                if self._stop.is_set() or not dist.is_initialized():
                    return
                logger.warning("ray_mesh wait sampler stopped: %s: %s", type(exc).__name__, exc)
                return

    def sample(self, now: float | None = None) -> None:
        """Take one sample (the thread calls this; tests may too)."""
        now = time.perf_counter() if now is None else now
        # A starved sampler must not credit a long gap to whatever it sees now.
        dt = min(now - self._last_t, 4 * self.interval_s)
        self._last_t = now
        for label, group in self.groups.items():
            seq = private_apis.group_sequence_number(group) or 0
            if self._seq.get(label) != seq:
                self._seq[label], self._moved[label] = seq, now
        hit: set[str] = set()
        mine = threading.get_ident()
        for ident, frame in sys._current_frames().items():
            if ident == mine or (self.thread_id is not None and ident != self.thread_id):
                continue
            label = self.classify(frame)
            if label is not None:
                hit.add(label)
        self._w_total += dt
        self._w_samples += 1
        if hit:
            self._w_any += dt
            for label in hit:
                self._w_wait[label] = self._w_wait.get(label, 0.0) + dt
        if now - self._w_start >= self.window_s:
            self._close(now)

    def classify(self, frame: Any) -> str | None:
        """The label of the group ``frame`` (a thread's innermost frame) waits on, or None."""
        filename = frame.f_code.co_filename
        if _DIST not in filename:
            return None
        if filename.endswith(_C10D):
            local = frame.f_locals
            for key in _GROUP_LOCALS:
                name = _group_name(local.get(key))
                if name is not None:
                    return self._by_name.get(name)  # None: not a mesh group
            return self._latest() if "wait(" in _line(frame) else None
        if filename.endswith(_FUNCOL) or ".wait(" in _line(frame):
            return self._latest()
        return None

    def _latest(self) -> str | None:
        """The group whose collective count moved last (an async collective's wait)."""
        return max(self._moved, key=self._moved.__getitem__) if self._moved else None

    def _close(self, now: float) -> None:
        # Every group, zeros included: a gauge not set again would keep an old figure.
        waits = {label: self._w_wait.get(label, 0.0) for label in self.groups}
        window: Window = {"window_s": self._w_total, "wait_s": waits,
                          "compute_s": self._w_total - self._w_any,
                          "samples": self._w_samples}
        self.last = window
        self._reset(now)
        if self.on_window is None:
            return
        try:
            self.on_window(window)
        except Exception as exc:  # noqa: BLE001 - exporting is best effort
            if not self._callback_failed:
                self._callback_failed = True
                logger.warning("ray_mesh wait sampler: exporting a window failed: %s: %s",
                               type(exc).__name__, exc)


def _group_name(group: Any) -> str | None:
    """The name of a ``group`` local, or None when it has none (yet).

    A frame inside ``distributed_c10d`` may hold a group that ``new_group`` is still
    building (the checkpointer's gloo group, ``checkpointing.sharded.checkpoint_group``,
    made while training runs): its ``group_name`` raises RuntimeError
    ("ProcessGroup name not set") until c10d names it, and ``hasattr`` only hides
    AttributeError. Such a group is not one of the mesh's, whose names are known."""
    if group is None:
        return None
    try:
        name = group.group_name
    except (AttributeError, RuntimeError):
        return None
    return name if isinstance(name, str) else None


def _line(frame: Any) -> str:
    lineno = frame.f_lineno  # None while a frame is between instructions (3.11)
    return linecache.getline(frame.f_code.co_filename, lineno) if lineno else ""
