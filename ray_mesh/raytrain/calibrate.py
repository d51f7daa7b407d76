"""A short calibration of each node's speed, for ``ray-mesh plan --calibrate``.

One Ray task per alive node (pinned there, ``NodeAffinitySchedulingStrategy``) times square
matmuls for about ``seconds`` on one of the node's devices: its first GPU when it has one,
else one CPU thread, since a CPU worker of ray_mesh runs its step on one thread (a Ray
worker's ``OMP_NUM_THREADS`` is 1). The answer is matmuls per second per device; the plan
divides by the fastest to get each node's relative speed. It is what a step's compute costs
on that box, not the step itself: a live run with ``shares="speed"`` measures the real one in
its first segments (:mod:`ray_mesh.replicas.shares`). Every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_mesh.planning.cluster import NodeInfo

SIZE_CPU, SIZE_GPU = 256, 4096


def _matmul_rate(use_gpu: bool, seconds: float) -> float:
    """Matmuls per second on this node's first GPU (``use_gpu``) or one CPU thread."""
    import torch

    if use_gpu and torch.cuda.is_available():
        dev, n = torch.device("cuda", 0), SIZE_GPU
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(1)
        dev, n, sync = torch.device("cpu"), SIZE_CPU, (lambda: None)
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    torch.mm(a, b)  # warm-up: allocator, kernels
    sync()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            torch.mm(a, b)
        sync()
        done += 4
    return done / (time.perf_counter() - t0)


def node_speeds(nodes: Sequence[NodeInfo], use_gpu: bool, seconds: float = 1.0,
                timeout_s: float = 60.0) -> dict[str, float | str]:
    """Each alive node's matmul rate (per device), by address; for a node that was not
    measured, why, as text: no answer within ``timeout_s`` (a busy or unreachable node is
    named, not waited for), or the error its task raised (e.g. ray_mesh or torch missing in
    that node's Python)."""
    task = ray.remote(_matmul_rate)
    refs = {}
    for n in nodes:
        if not n.alive:
            continue
        refs[n.ip] = task.options(
            num_cpus=0, num_gpus=1 if use_gpu and n.gpus >= 1 else 0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False),
        ).remote(use_gpu and n.gpus >= 1, seconds)
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    out: dict[str, float | str] = {}
    for ip, ref in refs.items():
        if ref not in ready:
            ray.cancel(ref, force=True)
            out[ip] = f"no answer in {timeout_s:g} s: busy or unreachable"
            continue
        try:
            out[ip] = float(ray.get(ref, timeout=1))
        except Exception as e:  # noqa: BLE001 - that node is named with its error
            out[ip] = f"the calibration task failed there: {_cause(e)}"
    return out


def _cause(error: BaseException) -> str:
    """The last line of a task's error (``RayTaskError`` carries the remote traceback)."""
    cause = getattr(error, "cause", None) or error
    text = f"{type(cause).__name__}: {cause}".strip().splitlines()
    return text[-1][:300] if text else type(error).__name__
