"""Where this code runs: inside a Ray Train worker, or not (torchrun, a plain script, a driver).

One test for every module that behaves differently under Ray Train (progress reports,
metrics tags and export, the checkpointer). It never imports Ray itself: a Ray Train worker
process has always imported Ray already (the worker runs inside it), so when ``ray`` is not
in ``sys.modules`` the answer is no, and a torchrun job does not pay Ray's import time.
"""

from __future__ import annotations

import os
import sys
from typing import Any

TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torchrun (torch elastic) in every rank; Ray Train never sets it."""


def train_context() -> Any | None:
    """Ray Train's ``TrainContext`` in a Ray Train worker (any thread), else None.

    None under torchrun, when Ray is not imported or not initialized, on the driver and in
    Ray tasks or actors that are not Train workers (``ray.train.get_context`` raises there).
    """
    if os.environ.get(TORCHRUN_ENV):
        return None
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        import ray.train

        return ray.train.get_context()
    except Exception:  # noqa: BLE001 - Ray Train V2 raises RuntimeError outside a worker
        return None


def in_ray_train() -> bool:
    """True inside a Ray Train worker: ``ray.train.report`` and its context work here."""
    return train_context() is not None
