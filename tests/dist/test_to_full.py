"""``replicas.reshard.to_full`` gathers an FSDP group's shards in one all-gather and gives the
same full tensors, bit for bit, as one ``DTensor.full_tensor`` per tensor: uneven dim-0
sizes (a rank with fewer rows, a rank with none), several dtypes, plain tensors between,
on real gloo groups of forked ranks."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch
from ports import free_port

SHAPES = [(7, 3), (5,), (1, 4), (2, 2, 3), (6,), (9, 2)]  # rows not a multiple of 2 or 3


def _rank(rank: int, world: int, port: int, out: mp.Queue) -> None:
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        from ray_mesh.replicas.reshard import to_full

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        g = torch.Generator().manual_seed(0)
        fulls = [torch.randn(s, generator=g) for s in SHAPES]
        fulls[2] = fulls[2].to(torch.bfloat16)  # a second dtype among the sharded
        likes, locals_ = [], []
        for i, f in enumerate(fulls):
            placement = Replicate() if i == 4 else Shard(0)  # one not on dim 0: per tensor
            dt = distribute_tensor(f, mesh, [placement])
            likes.append(dt)
            locals_.append(dt.to_local().clone())
        likes.insert(3, None)  # a plain tensor (a group's own, unsharded) passes through
        plain = torch.arange(5.0)
        locals_.insert(3, plain)
        got = to_full(locals_, likes)
        want = [lk.full_tensor() if lk is not None else plain for lk in likes]
        same = all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                   for a, b in zip(got, want, strict=True))
        out.put((rank, same, [tuple(t.shape) for t in got]))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, False, traceback.format_exc()))


@pytest.mark.parametrize("world", [2, 3])
def test_one_gather_gives_what_full_tensor_gives(world):
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    for rank, same, detail in results:
        assert same, f"rank {rank}: {detail}"
    expected = [SHAPES[0], SHAPES[1], SHAPES[2], (5,), *SHAPES[3:]]
    assert all(detail == expected for _, _, detail in results)
