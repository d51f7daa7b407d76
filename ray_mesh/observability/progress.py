"""The console's progress line, read from what the train function passes to ``ray_mesh.report``.

A run's progress is what its reports say: ``ray_mesh.report({"step": 10, "loss": 0.4})`` on
every rank (``ray.train.report`` with ray_mesh's bookkeeping), and ray_mesh's report recorder
(:mod:`ray_mesh.observability.report`) shows one line per report on world rank 0::

    hsdp: step 10/40 loss 0.4053  23.1 steps/s  1481 samples/s  ETA 1s

The step count comes from the reported ``step`` key (else the number of reports), ``/40``
and the ETA from ``MeshConfig(total_steps=...)`` (``ray-mesh run`` passes the job's
``config.steps``), the rates from the recorder's clock between reports, samples/s and
tokens/s from reported ``samples`` / ``tokens`` counts; a first report has no interval, so
rates it carries itself (``tokens_per_s``, a loop that times itself) are shown for it. Every
other number in the report is shown as ``key value``.

Lines go through logging: Ray Train's worker logging shows a logger's INFO line once on the
driver's console, while a ``print`` in a train function shows twice where Ray Train's print
patch is on: it both logs it and echoes it (upstream: ray-train-print-patch-twice).
"""

from __future__ import annotations

import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

COUNTERS = ("step", "samples", "tokens")  # counts; their rates are shown instead
RATES = (("steps_per_s", "steps/s", ".3g"), ("samples_per_s", "samples/s", ".4g"),
         ("tokens_per_s", "tokens/s", ".4g"))
_RATE_KEYS = {key for key, _, _ in RATES}  # a reported rate is shown as a rate, not a number


def carried_rates(metrics: dict[str, Any]) -> dict[str, float]:
    """The rates a report carries (a loop that times itself), those above 0 only: a loop
    that has no interval yet reports 0, which is not a rate to show."""
    return {key: float(metrics[key]) for key, _, _ in RATES
            if isinstance(metrics.get(key), int | float) and not isinstance(metrics[key], bool)
            and metrics[key] > 0}


def duration(seconds: float) -> str:
    """``2h03m``, ``4m05s``, ``7s``."""
    seconds = max(0, int(round(seconds)))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _number(key: str, value: float) -> str:
    return f"{value:.4f}" if key == "loss" else f"{value:.4g}"


def progress_line(name: str, step: float, total: int | None, numbers: dict[str, float],
                  rates: dict[str, float]) -> str:
    """``name: step 10/40 loss 0.4053  23.1 steps/s  1481 samples/s  ETA 1s``.

    ``numbers``: the report's numeric keys (counters left out); ``rates``: steps_per_s and,
    when known, samples_per_s / tokens_per_s."""
    head = f"{name}: step {step:g}" + (f"/{total}" if total else "")
    shown = [f"{key} {_number(key, value)}" for key, value in numbers.items()
             if key not in COUNTERS and key not in _RATE_KEYS]
    parts = [" ".join([head, *shown])]
    parts += [f"{format(rates[key], spec)} {unit}" for key, unit, spec in RATES if key in rates]
    speed = rates.get("steps_per_s")
    if total and speed:
        parts.append(f"ETA {duration(max(0.0, total - step) / speed)}")
    return "  ".join(parts)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LINE = re.compile(r"^([\w.-]+): step ([0-9][0-9.e+]*)(?:/\d+)?(?:\s|$)")


def parse_progress(line: str) -> tuple[str, float] | None:
    """``(name, step)`` of a line :func:`progress_line` made (colour codes ignored), else
    None: the driver reads back which steps' lines reached its console."""
    m = _LINE.match(_ANSI.sub("", line))
    if m is None:
        return None
    try:
        return m[1], float(m[2])
    except ValueError:  # "1.2.3": digits and dots, not a number
        return None


def show(line: str) -> None:
    """One line on the driver's console, once (see the module docstring)."""
    logger.info("%s", line)

