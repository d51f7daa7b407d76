"""The workers' last progress lines on the driver's console before the run's summary.

Ray forwards what a worker prints through its node's log monitor, which publishes a log
file's new lines each time it polls, to a thread of the driver that prints them. ``fit()``
returns as soon as Ray Train's controller is done, and the CLI then prints its summary and
disconnects: an embedded Ray's ``ray.shutdown()`` stops that printing thread at once, and
at interpreter exit Ray waits only 0.5 s. On a busy node the last lines are still on their
way then, and never show: seen in CI (2 cores), a replica group's ``lab-g1: step 40/40``
line missing from a console whose summary had that group's figures.

So the CLI watches the lines Ray prints (:func:`ray_mesh.private_apis.watch_worker_output`)
and, after the fit, waits until each run's progress line of its last report has been
printed, at most :data:`TAIL_WAIT_S` (upstream: ray-driver-log-tail). A run's last report
always has a line when its step reaches the run's total (``ReportRecorder._line_due``); only
those are waited for, so a run that reports 0-based steps, or no steps, never waits. Usually
the line is already there and the wait is nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ray_mesh.observability.progress import parse_progress

TAIL_WAIT_S = 15.0
"""The longest wait for the last progress lines: a starved node's log monitor has taken
seconds; past this the summary goes first and says which line is late."""

class ProgressTail:
    """The highest step of each run name's progress lines printed so far."""

    def __init__(self, printing: Callable[[], bool] = lambda: True) -> None:
        self.seen: dict[str, float] = {}
        self.printing = printing  # whether Ray prints the workers' lines here at all
        self._changed = threading.Condition()

    def observe(self, data: Mapping[str, Any]) -> None:
        """One batch of forwarded worker output (Ray's printing thread calls this)."""
        found: dict[str, float] = {}
        for line in data.get("lines") or ():
            got = parse_progress(str(line))
            if got is not None:
                found[got[0]] = max(found.get(got[0], got[1]), got[1])
        if found:
            with self._changed:
                for name, step in found.items():
                    self.seen[name] = max(self.seen.get(name, step), step)
                self._changed.notify_all()

    def missing(self, expected: Mapping[str, float]) -> list[str]:
        """The names whose line of step ``expected[name]`` has not been printed."""
        return [name for name, step in expected.items() if self.seen.get(name, -1.0) < step]

    def wait(self, expected: Mapping[str, float], timeout_s: float = TAIL_WAIT_S,
             say: Callable[[str], None] | None = None) -> list[str]:
        """Wait until every expected line has been printed, at most ``timeout_s``; returns
        (and with ``say``, names in one line) the runs whose line had not come by then."""
        if not self.printing():  # ray.init(log_to_driver=False): no line will come
            return []
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while (late := self.missing(expected)) and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
        if late and say is not None:
            names = ", ".join(f"{n} (step {expected[n]:g})" for n in late)
            say(f"the last progress line of {names} had not reached this console "
                f"{timeout_s:.0f} s after the run ended: Ray's log stream from its node is "
                f"late (a busy node); the summary below has its figures")
        return late


def final_steps(runs: Mapping[str, Mapping[str, Any]], total_steps: int | None
                ) -> dict[str, float]:
    """The progress lines to wait for: run name -> its last reported ``step``, for each run
    whose last report reached ``total_steps`` (those always have a line)."""
    out = {}
    for name, metrics in runs.items():
        step = metrics.get("step")
        if (total_steps and isinstance(step, int | float) and not isinstance(step, bool)
                and step >= total_steps):
            out[name] = float(step)
    return out


@contextmanager
def progress_tail() -> Iterator[ProgressTail]:
    """A :class:`ProgressTail` fed with every batch of worker output while the block runs."""
    from ray_mesh.private_apis import watch_worker_output, worker_output_printed

    tail = ProgressTail(worker_output_printed)
    stop = watch_worker_output(tail.observe)
    try:
        yield tail
    finally:
        stop()

