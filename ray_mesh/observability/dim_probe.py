"""A direct measure of each mesh dim's link: all-reduce latency and bus bandwidth.

The collectives of FSDP2, tensor-parallel modules and pipelining overlap compute, so their
time says little about the link; a plain all-reduce per dim, timed once, does.
"""

from __future__ import annotations

import time

import torch

from ray_mesh.core import bootstrap
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS
from ray_mesh.observability import active
from ray_mesh.observability.export import mesh_tags

MESH_DIMS: tuple[str, ...] = (*DIM_NAMES, *FLATTENED_DIMS)


def probe_dims(
    dims: tuple[str, ...] | None = None,
    nbytes: int = 1 << 20,
    iters: int = 5,
    export: bool = True,
) -> dict[str, tuple[float, float]]:
    """Time an all-reduce of ``nbytes`` on every mesh dim of size > 1 (all ranks must call).

    Returns dim -> (median seconds, bus bandwidth in bytes/s, nccl-tests' definition
    ``nbytes * 2 (n-1) / n / t``). With ``export``, inside a run, they go to the run's
    metrics as ``mesh_dim_allreduce_seconds`` and ``mesh_dim_busbw_bytes_per_second``.

    Stability: experimental
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
    exporter = getattr(active.current(), "exporter", None)
    if export and exporter is not None:
        tags = mesh_tags()
        rec = []
        for dim, (secs, busbw) in results.items():
            rec += [("mesh_dim_allreduce_seconds", secs, {**tags, "dim": dim}),
                    ("mesh_dim_busbw_bytes_per_second", busbw, {**tags, "dim": dim})]
        exporter.record(rec)
    return results


__all__ = ["probe_dims"]
