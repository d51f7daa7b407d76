"""Waiting on the workers with a deadline (controller side): bring-up never hangs."""

from __future__ import annotations

import time

import ray

from ray_mesh.errors import BringUpError

BRINGUP_FIX = ("A process group that never forms usually means the nodes cannot reach each "
               "other on the chosen interface or port: run `ray-mesh doctor`, check firewalls, "
               "or pass MeshConfig(interface=...). Raise MeshConfig(bringup_timeout_s=...) if "
               "the nodes are just slow.")


def wait_bounded(refs: list, timeout_s: float, what: str, labels: list[str],
                 fix: str | None = None) -> list:
    """ray.get with a deadline that fails on the first error instead of waiting for all;
    ``fix``: what the error past the deadline tells the user to do (default: bring-up's)."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = [labels[refs.index(r)] for r in pending]
            raise BringUpError(
                f"{what} did not finish within {timeout_s:.0f} s on {len(late)} of {len(refs)} "
                f"workers: {', '.join(late)}. " + (fix or BRINGUP_FIX))
        done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        for ref in done:
            ray.get(ref)  # re-raises the worker's error at once
    return ray.get(refs)
