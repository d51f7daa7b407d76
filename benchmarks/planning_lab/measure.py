"""What the calibration measures on a live process group: torch only, no Ray, no model.

Every function here is a collective (every rank calls it) and returns the same figures on
every rank (medians over repeats and ranks, :func:`median_everywhere`), so a planner on any
rank sees one calibration. The figures feed :class:`benchmarks.planning_lab.calibrate.Calibration`;
what they mean for a step time is :mod:`benchmarks.planning_lab.calibrate`'s docstring.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.planning_lab.calibrate import unit_key
from ray_mesh.planning.cost import FP32, PlanError


def node_pipeline_mesh(pp: int, device_type: str = "cpu"):
    """A ``("dp_replicate", "pp")`` DeviceMesh whose pp groups are ``pp`` consecutive ranks
    (inside a node, as ray_mesh places ranks), for :func:`pipeline_key`'s shape. ray_mesh's
    own meshes put pp outermost, across nodes; this one keeps the stages' sends in a node."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size()
    if pp < 2 or world % pp:
        raise PlanError(f"pp={pp} must be >= 2 and divide the world size {world}")
    ranks = torch.arange(world).reshape(world // pp, pp)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("dp_replicate", "pp"))



def _median_time(fn, n: int) -> float:
    """Median seconds of ``n`` calls of ``fn``, each after a barrier (a collective)."""
    import torch.distributed as dist

    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def node_groups(per_node: int) -> list:
    """One process group per node (``per_node`` consecutive ranks, as ray_mesh places them),
    created by every rank in the same order, as ``new_group`` requires."""
    import torch.distributed as dist

    world = dist.get_world_size()
    return [dist.new_group(list(range(s, s + per_node))) for s in range(0, world, per_node)]


def measure_cross(per_node: int, nbytes: int, repeats: int = 3) -> dict[str, float]:
    """``cross_call_s`` and ``cross_Bps``: the link between nodes as gloo sees it.

    Rank ``j`` of every node joins the group of the ranks with the same local index on the
    other nodes (ray_mesh's node-aligned replicate groups), and all groups all-reduce at
    once, as an HSDP replicate reduction does: a one-element tensor (the fixed cost of a
    call across nodes, round trip included) and ``nbytes`` (wire, kernel and gloo's work
    per byte). ``cross_Bps`` is the bytes a node sent across per second. A collective;
    every rank must call it; needs at least 2 nodes.
    """
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if per_node < 1 or world % per_node or world // per_node < 2:
        raise PlanError(f"per_node={per_node} must divide the world size {world} into 2 or "
                        "more nodes")
    nodes = world // per_node
    groups = [dist.new_group(list(range(j, world, per_node))) for j in range(per_node)]
    mine = groups[rank % per_node]

    tiny, big = torch.zeros(1), torch.zeros(max(1, nbytes // FP32))
    call = median_everywhere(_median_time(lambda: dist.all_reduce(tiny, group=mine),
                                          10 * repeats))
    big_s = median_everywhere(_median_time(lambda: dist.all_reduce(big, group=mine), repeats))
    sent = per_node * 2 * (nodes - 1) / nodes * big.numel() * FP32  # one node, a ring each
    # one all-reduce over the world: a single ring, one flow out of each node (DDP, flat
    # FSDP), at two sizes: bytes per second from their difference, and what a call costs
    # beyond its bytes (each ring step waits on the one before, through the link's queue)
    quarter = torch.zeros(max(1, big.numel() // 4))
    ring_s = median_everywhere(_median_time(lambda: dist.all_reduce(big), repeats))
    small_s = median_everywhere(_median_time(lambda: dist.all_reduce(quarter), repeats))
    edge = 2 * (world - 1) / world * FP32  # bytes on the node's one cross edge per element
    if ring_s - small_s > 0.1 * ring_s:  # the 4x buffer took measurably longer: fit both
        ring_Bps = edge * (big.numel() - quarter.numel()) / (ring_s - small_s)
        ring_call = max(call, small_s - edge * quarter.numel() / ring_Bps)
    else:  # noise hid the difference (a fast link): the big one alone, a tiny call's cost
        ring_Bps, ring_call = edge * big.numel() / max(ring_s - call, 1e-6), call
    return {"cross_call_s": call, "cross_Bps": sent / max(big_s - call, 1e-6),
            "ring_Bps": ring_Bps, "ring_call_s": ring_call}


def median_everywhere(value: float) -> float:
    import torch.distributed as dist

    everyone: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return float(statistics.median(everyone))


def measure_collectives(per_node: int, reduce_bytes: int, p2p_bytes: int,
                        repeats: int = 20) -> dict[str, float]:
    """``collective_s``, ``gloo_Bps`` and ``p2p_s`` on the live process group, inside nodes.

    Every node's ranks form a group (consecutive ranks, as ray_mesh places them) and all
    nodes measure at once. A collective; every rank must call it. ``per_node`` must divide
    the world size and be >= 2 for the point-to-point figure (else it is 0).
    """
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if per_node < 1 or world % per_node:
        raise PlanError(f"per_node={per_node} must divide the world size {world}")
    mine = node_groups(per_node)[rank // per_node]

    tiny, big = torch.zeros(1), torch.zeros(max(1, reduce_bytes // FP32))
    call = _median_time(lambda: dist.all_reduce(tiny, group=mine), repeats)
    big_s = _median_time(lambda: dist.all_reduce(big, group=mine), max(3, repeats // 4))
    volume = 2 * (per_node - 1) / per_node * big.numel() * FP32
    p2p = 0.0
    if per_node >= 2:
        buf = torch.zeros(max(1, p2p_bytes // FP32))
        local = rank % per_node
        peer = rank + 1 if local % 2 == 0 else rank - 1

        def exchange() -> None:  # there and back: a forward send and a backward send
            if peer >= (rank // per_node + 1) * per_node:
                return  # odd rank count in a node: the last rank sits out
            if local % 2 == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
        p2p = _median_time(exchange, repeats) / 2
    call = median_everywhere(call)
    return {"collective_s": call,
            "gloo_Bps": volume / max(median_everywhere(big_s) - call, 1e-6),
            "p2p_s": median_everywhere(p2p)}


def measure_pipeline_send(per_node: int, nbytes: int, repeats: int = 5) -> float:
    """``send_s``: seconds for one microbatch's activations to cross a stage boundary.

    Rank ``j`` of node ``2k`` sends ``nbytes`` to rank ``j`` of node ``2k + 1``, every pair
    at once: one flow per rank of a node, as a pipeline layout's pipelines send side by
    side, and one direction only, as a GPipe phase sends (forward all one way, backward all
    the other; an all-reduce's link carries both, and the reverse data competes with the
    acknowledgements in the shaped queue). Timed on the receivers between barriers: the
    median over repeats of the slowest receiver, wire, kernel and gloo's work in it. A
    collective; every rank must call it; needs at least 2 nodes.
    """
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if per_node < 1 or world % per_node or world // per_node < 2 or nbytes < 1:
        raise PlanError(f"per_node={per_node} must divide the world size {world} into 2 or "
                        f"more nodes, and nbytes={nbytes} be >= 1")
    node = rank // per_node
    receiving = node % 2 == 1
    peer = (rank - per_node if receiving else
            rank + per_node if (node + 1) * per_node < world else None)
    buf = torch.zeros(max(1, nbytes // FP32))

    def once() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if peer is not None:
            (dist.recv if receiving else dist.send)(buf, peer)
        return time.perf_counter() - t0

    once()  # warm-up: the pair's first message
    mine = [once() for _ in range(repeats)]
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine if receiving else None)
    slowest = [max(t[i] for t in everyone if t is not None) for i in range(repeats)]
    return float(statistics.median(slowest))


def measure_unit_collectives(per_node: int, unit_bytes: int, reduce_dtypes=("fp32",),
                             repeats: int = 5) -> dict[str, float]:
    """Seconds of one FSDP unit's collectives as FSDP2 issues them (``all_gather_single``
    of the parameters, ``reduce_scatter_single`` of the gradients) over each node's ranks,
    all nodes at once: ``{unit_key(...): seconds}``, medians over repeats and ranks.
    ``unit_bytes`` is one unit's fp32 parameters. What a node-local FSDP step spends in its
    collectives, which a layout with ``dp_shard`` 1 (tp_hsdp) does not run. A collective;
    every rank must call it.
    """
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    if per_node < 1 or world % per_node or unit_bytes < 1:
        raise PlanError(f"per_node={per_node} must divide the world size {world}, and "
                        f"unit_bytes={unit_bytes} be >= 1")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if unknown := set(reduce_dtypes) - set(dtypes):
        raise PlanError(f"reduce dtypes {sorted(unknown)}: give 'fp32' or 'bf16'")
    group = node_groups(per_node)[rank // per_node]
    numel = max(per_node, unit_bytes // FP32 // per_node * per_node)
    out: dict[str, float] = {}
    for kind, name in [("ag", "fp32")] + [("rs", d) for d in reduce_dtypes]:
        full = torch.zeros(numel, dtype=dtypes[name])
        part = torch.zeros(numel // per_node, dtype=dtypes[name])

        def call(full=full, part=part, kind=kind) -> None:
            if kind == "ag":
                dist.all_gather_single(full, part, group=group)
            else:
                dist.reduce_scatter_single(part, full, group=group)
        call()  # warm-up
        out[unit_key(kind, name)] = median_everywhere(_median_time(call, repeats))
    return out


__all__ = ["measure_collectives", "measure_cross", "measure_pipeline_send",
           "measure_unit_collectives", "median_everywhere", "node_groups", "node_pipeline_mesh"]
