"""The learning-rate schedule of the LM job: linear warm-up, then cosine decay to a floor.

One definition for ``examples/llm.py`` and the benchmarks that train the same model, so a
benchmark's run is the example's run.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """The factor on the base learning rate at ``step`` (0-based): ``(step+1)/warmup`` during
    warm-up, then a cosine from 1 down to ``min_ratio`` at ``total`` steps (held after)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
