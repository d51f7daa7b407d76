"""A direct measure of each mesh dim's link: all-reduce latency and bus bandwidth.

For the collectives that :class:`~ray_mesh.observability.meter.StepMeter` cannot see (those
inside FSDP2, tensor-parallel modules or pipelining), time a plain all-reduce per dim.
"""

from __future__ import annotations

import time

import torch

from ray_mesh.core import bootstrap
from ray_mesh.observability.meter import MESH_DIMS, StepMeter


def probe_dims(
    dims: tuple[str, ...] | None = None,
    nbytes: int = 1 << 20,
    iters: int = 5,
    meter: StepMeter | None = None,
) -> dict[str, tuple[float, float]]:
    """Time an all-reduce of ``nbytes`` on every mesh dim of size > 1 (all ranks must call).

    Returns dim -> (median seconds, bus bandwidth in bytes/s, nccl-tests' definition
    ``nbytes * 2 (n-1) / n / t``), and exports them through ``meter`` when given. A direct
    measure of each dim's link, for the collectives that :class:`StepMeter` cannot see.
    """
    import torch.distributed as dist

    state = bootstrap.get_state()
    mesh = state.mesh
    dims = dims or tuple(d for d in MESH_DIMS if bootstrap.submesh(mesh, d).size() > 1)
    numel = max(1, nbytes // 4)
    buf = torch.ones(numel, dtype=torch.float32, device=state.device)
    results: dict[str, tuple[float, float]] = {}
    for dim in dims:
        n = bootstrap.submesh(mesh, dim).size()
        if n < 2:
            continue
        group = mesh.get_group(dim)
        dist.all_reduce(buf, group=group)  # warm-up: connection setup is not the link
        times = []
        for _ in range(iters):
            if state.device.type == "cuda":
                torch.cuda.synchronize(state.device)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if state.device.type == "cuda":
                torch.cuda.synchronize(state.device)
            times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        results[dim] = (med, numel * 4 * 2 * (n - 1) / n / med)
    if meter is not None:
        meter.record_probe(results)
    return results


__all__ = ["probe_dims"]
