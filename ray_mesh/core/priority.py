"""CPU priority of training processes: undo Ray's ``nice +15`` on training workers.

Ray starts every worker process at niceness 15 (``RAY_worker_niceness``, so that raylet
and GCS stay responsive when tasks saturate the CPUs); torchrun's ranks run at 0. A
training rank is the job, not a background task: at nice 15 it gets about 1/28 of the CPU
share of any nice-0 process it competes with (raylet, the dashboard agent, a data loader
started elsewhere, another user's shell), and the Python thread that feeds the GPU or runs
gloo stalls behind them. ray_mesh sets its training workers to niceness 0 at bring-up.

Linux applies niceness per thread, and a new thread inherits its creator's: so every
thread of the process is set (``/proc/self/task``), before the process group starts its
threads, and again when the training thread starts (``MeshConfig.train_func_context``).
Lowering niceness needs root or ``CAP_SYS_NICE``; without it the result says so and the
Ray glue prints the fix (``RAY_worker_niceness=0`` in the environment of ``ray start``).
Ray-free and torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

RAY_NICENESS_ENV = "RAY_worker_niceness"
"""Read by every Ray worker process at start (inherited from raylet's environment)."""

NICENESS_RANGE = range(-20, 20)
"""What Linux accepts: -20 (most favoured) to 19."""

_wanted: int | None = None


@dataclass(frozen=True)
class NicenessResult:
    """What one process saw: niceness before, after, and why it could not be set."""

    before: int
    after: int
    threads: int
    error: str | None = None


def _thread_ids() -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:  # not Linux: process-wide niceness is all there is
        return [0]


def current_niceness() -> int:
    """Niceness of the calling thread (on Linux, ``PRIO_PROCESS`` with 0 means the thread)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def set_niceness(target: int) -> NicenessResult:
    """Set every thread of this process to ``target`` and remember it for :func:`reapply`.

    Never raises for a refused change: the result carries the error, and threads already
    changed keep the new value.
    """
    global _wanted
    if target not in NICENESS_RANGE:
        raise ValueError(f"niceness must be between -20 and 19, got {target}.")
    _wanted = target
    before = current_niceness()
    tids = _thread_ids()
    error = None
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except PermissionError as exc:
            error = (f"{exc.strerror or exc} (lowering niceness from {before} to {target} "
                     f"needs root or CAP_SYS_NICE)")
            break
    return NicenessResult(before=before, after=current_niceness(), threads=len(tids),
                          error=error)


def reapply() -> NicenessResult | None:
    """Set the remembered niceness again on every thread (threads started since included)."""
    if _wanted is None:
        return None
    return set_niceness(_wanted)
