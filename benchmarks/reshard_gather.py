"""An FSDP group's gradients as full tensors at a boundary between replica groups of
different layouts: one gather per tensor against one gather for all.

    python -m benchmarks.reshard_gather [--rounds 15] [--out FILE]

Two ranks forked from this process (gloo on loopback), the LM's small preset
(``examples/llm.py``, ~1.7M parameters) under FSDP2 over both (``dp_shard=2``, as the lab
job's desktop and tower run it), random gradients of each parameter's local shard. Each
round times, on both ranks after a barrier, the gradients gathered per tensor
(``DTensor.from_local`` and ``ray_mesh.parallel.compose.full_tensor`` for each: what
``replicas.reshard.to_full`` did before) and then through ``to_full`` (one all-gather per
dtype for ``Shard(0)`` shards on a 1-D mesh); both give the same tensors (checked each
round). Side by side, alternating, in two settings: the machine's CPUs, and both ranks in
one cgroup capped at ``--cores`` (0.4, the lab's tower: ``harness.netns.cpu``), where the
per-tensor gathers waited most. Statistic: the median over rounds of rank 0's time;
``ratio`` per tensor / one gather. Written to ``results.json["reshard_gather"]`` with the
1-minute load at the start and end of each setting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results.json"


def _per_tensor(locals_, likes):
    from torch.distributed.tensor import DTensor

    from ray_mesh.parallel.compose import full_tensor

    return [full_tensor(DTensor.from_local(t, lk.device_mesh, lk.placements, run_check=False,
                                           shape=lk.shape, stride=lk.stride()))
            for t, lk in zip(locals_, likes, strict=True)]


def _rank(rank: int, port: int, rounds: int, out) -> None:
    sys.path.insert(0, str(REPO / "examples"))
    import torch
    import torch.distributed as dist
    from llm import make_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ray_mesh import shutdown_mesh
    from ray_mesh.replicas.reshard import to_full

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = make_model()
    for block in model.layers:  # an nn.ModuleList of blocks, each its own FSDP unit
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    likes = list(model.parameters())
    grads = [torch.randn_like(p.to_local()) for p in likes]
    times: dict[str, list[float]] = {"per_tensor": [], "one_gather": []}
    for _ in range(rounds + 2):  # the first two rounds warm up, not counted
        got = {}
        for side, fn in (("per_tensor", _per_tensor), ("one_gather", to_full)):
            dist.barrier()
            t0 = time.perf_counter()
            got[side] = fn(grads, likes)
            times[side].append(time.perf_counter() - t0)
        assert all(torch.equal(a, b) for a, b in zip(got["per_tensor"], got["one_gather"],
                                                      strict=True))
    if rank == 0:
        out.put({"tensors": len(likes), "values": sum(p.numel() for p in likes),
                 **{k: v[2:] for k, v in times.items()}})
    del model, grads, likes, got, mesh
    shutdown_mesh()  # frees the mesh's gloo group now, not at exit (ray_mesh.core.teardown)


def measure(rounds: int, cores: float | None) -> dict:
    from benchmarks.common import forked, free_port, two_sides

    port = free_port()
    got, load0 = forked(_rank, [(r, port, rounds) for r in (0, 1)], cores,
                        "rm_reshard_gather", 600)
    return {"cores": cores, "tensors": got["tensors"], "values": got["values"],
            **two_sides(got, "per_tensor", "one_gather", rounds, load0)}


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import side_by_side

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cores", type=float, default=0.4)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    side_by_side("reshard_gather", args.out,
                 "median over rounds of rank 0's time (after 2 warm-up rounds)",
                 lambda cores: measure(args.rounds, cores), args.cores,
                 lambda s: f"{s['tensors']} tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
