"""Progress for a train loop that runs under Ray Train or under torchrun, unchanged.

``ray.train.report`` raises outside a Ray Train worker, so a loop that must also run under
torchrun would need its own guard; :func:`log_step` carries it once for every example.
"""

from __future__ import annotations

import torch.distributed as dist

from ray_mesh.core.runtime import in_ray_train


def report(metrics: dict) -> None:
    """``ray.train.report(metrics)`` inside Ray Train; nothing under torchrun."""
    if in_ray_train():
        import ray.train

        ray.train.report(metrics)


def log_step(name: str, step: int, steps: int, loss: float, every: int) -> None:
    """On the first, every ``every``-th and the last step: rank 0 prints, every rank reports.

    ``step`` counts from 0; the printed and reported step counts from 1. Every rank must
    call it, since Ray Train's report is a collective over the workers.
    """
    done = step + 1
    if done % every and step != 0 and done != steps:
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{name}: step {done}/{steps} loss {loss:.4f}", flush=True)
    report({"step": done, "loss": loss})
