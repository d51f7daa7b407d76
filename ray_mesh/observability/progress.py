"""Progress for a train loop that runs under Ray Train or under torchrun, unchanged.

``ray.train.report`` raises outside a Ray Train worker, so a loop that must also run under
torchrun would need its own guard; :func:`log_step` carries it once for every example.

Lines go through logging under Ray Train: Ray Train's worker logging shows a logger's INFO
line once on the driver's console, while a ``print`` in a train function shows twice (Ray
2.60's print patch both logs it and echoes it). Under torchrun they are printed.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from ray_mesh.core.runtime import in_ray_train

logger = logging.getLogger(__name__)


def say(line: str) -> None:
    """One line on the console, once: logging under Ray Train, print elsewhere."""
    if in_ray_train():
        logger.info("%s", line)
    else:
        print(line, flush=True)


def report(metrics: dict) -> None:
    """``ray.train.report(metrics)`` inside Ray Train; nothing under torchrun."""
    if in_ray_train():
        from ray_mesh.observability.report import _train_report

        _train_report()(metrics)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class _Clock:
    """When the loop's first step finished (ETA and throughput count from there)."""

    t0: float | None = None
    step0 = 0


def rates(done: int, samples_per_step: float | None = None) -> dict[str, float]:
    """steps/s (and samples/s) since the first step this process showed, once two exist."""
    now = time.perf_counter()
    if _Clock.t0 is None or done <= _Clock.step0:
        _Clock.t0, _Clock.step0 = now, done
        return {}
    elapsed, ran = now - _Clock.t0, done - _Clock.step0
    out = {"steps_per_s": ran / elapsed} if elapsed > 0 else {}
    if out and samples_per_step:
        out["samples_per_s"] = out["steps_per_s"] * samples_per_step
    return out


def progress_line(name: str, done: int, steps: int, loss: float,
                  speed: dict[str, float]) -> str:
    """``name: step 10/40 loss 0.4053  12.1 steps/s  194 samples/s  ETA 2s``."""
    parts = [f"{name}: step {done}/{steps} loss {loss:.4f}"]
    if "steps_per_s" in speed:
        parts.append(f"{speed['steps_per_s']:.3g} steps/s")
        if "samples_per_s" in speed:
            parts.append(f"{speed['samples_per_s']:.4g} samples/s")
        parts.append(f"ETA {_duration((steps - done) / speed['steps_per_s'])}")
    return "  ".join(parts)


def log_step(name: str, step: int, steps: int, loss: float, every: int,
             samples_per_step: float | None = None) -> None:
    """Record every step's loss; on the first, every ``every``-th and the last step, rank 0
    shows a progress line and every rank calls ``ray.train.report``.

    ``step`` counts from 0; the shown and reported step counts from 1. Every rank must call
    it, since Ray Train's report is a collective over the workers. The steps in between reach
    the metrics pipeline (``ray_mesh.observability.report``) without ``ray.train.report``'s
    wait for the controller. ``samples_per_step`` (the global batch) adds samples/s. The last
    report carries the training throughput (``steps_per_s``, ``samples_per_s``), which
    ``ray-mesh run`` shows in its summary.
    """
    from ray_mesh.observability.report import recorder

    done = step + 1
    metrics: dict[str, float] = {"step": done, "loss": loss}
    recorder().observe(metrics)
    if done % every and step != 0 and done != steps:
        return
    speed = rates(done, samples_per_step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        say(progress_line(name, done, steps, loss, speed))
    if done == steps:
        metrics.update(speed)
        recorder().latest.update(speed)  # for the run's summary (report.save_summary)
    report(metrics)
