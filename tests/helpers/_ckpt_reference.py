"""The uninterrupted references of the checkpoint tests' bitwise resumes, without Ray.

    python _ckpt_reference.py <out.pt> <port> [steps]     # hsdp (8 steps by default)
    python _ckpt_reference.py diloco <out> <port>         # diloco: <out>.<rank>

``hsdp`` (tests/netns/test_checkpoint_netns.py, 8 steps; tests/ray/test_checkpoint_ray.py,
12): ``harness/ckpt_train.py``'s training (its model, seed, dropout 0.3 and batches; AdamW;
the HSDP mesh ``dp_replicate=2 x dp_shard=2`` of the runs' 4 workers) on 4 local ranks over
gloo on loopback, with no checkpoint taken; rank 0 saves the final full parameters to
``out.pt``.
``diloco`` (tests/ray/test_checkpoint_s3_ray.py): ``tests/helpers/_diloco_train.py``'s
training (FSDP inside each replica, DiLoCo over ``dp_replicate=2`` every 3 steps, outer lr
0.7, momentum 0.9) for 8 steps on 2 ranks, no checkpoint taken; each rank saves its local
shards to ``<out>.<rank>``, as that train function does.

Each is bitwise what the same uninterrupted run under Ray Train ends with (the same ranks,
groups and reductions: the collectives' transport does not enter the numbers), at a
fraction of a Ray Train bring-up: the ranks are forked from this process after one import
of torch and ray_mesh, not started as fresh workers.
"""

from __future__ import annotations

import os
import sys
import time

# One intra-op thread per rank, as Ray gives a worker of CPU 0.5 (and torchrun its ranks).
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import ray_mesh  # noqa: E402
from harness.ckpt_train import DILOCO_DROPOUT, batch, make_model  # noqa: E402
from ray_mesh.checkpointing import full_model_state  # noqa: E402
from ray_mesh.parallel import dp_rank as dp_rank_of  # noqa: E402
from ray_mesh.parallel import parallelize, replicate_dp_mode, wrap_replicate  # noqa: E402

# Each test's run: workers, steps (tests/helpers/_ckpt_elastic_driver.py's "kill" mode;
# test_diloco_outer_state_resumes_from_the_bucket's base config and MeshConfig).
WORLD = {"hsdp": 4, "diloco": 2}
STEPS = 8
DILOCO_LAYOUT = {"mesh": {"dp_replicate": 2, "dp_shard": 1},
                 "replicate": {"mode": "diloco", "every": 3, "outer_lr": 0.7,
                               "outer_momentum": 0.9}}
TIMEOUT_S = 240


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))


def rank_main(rank: int, mode: str, out: str, port: int, steps: int) -> None:
    _env(rank, WORLD[mode], port)
    (hsdp if mode == "hsdp" else diloco)(rank, out, steps)


def hsdp(rank: int, out: str, steps: int) -> None:
    mesh = ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_replicate=2, dp_shard=2))
    model = make_model(0.3)  # as harness/ckpt_train.train_loop with config {"dropout": 0.3}
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    dp_rank = dp_rank_of(mesh)
    for step in range(steps):
        x, y = batch(step, dp_rank)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    full = full_model_state(model)
    if rank == 0:
        torch.save(full, out)
    del model, optim  # their process groups are freed by shutdown_mesh
    ray_mesh.shutdown_mesh()


def diloco(rank: int, out: str, steps: int) -> None:
    """As tests/helpers/_diloco_train.train_loop, less its checkpoints and log."""
    mesh = ray_mesh.init_mesh(layout=DILOCO_LAYOUT)
    model = parallelize(make_model(DILOCO_DROPOUT), mesh, dp=replicate_dp_mode())
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    dl = wrap_replicate(model, mesh)
    replica = mesh["dp_replicate"].get_local_rank()
    for step in range(steps):
        x, y = batch(step, replica)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        dl.step()
    dl.flush()
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
             for k, v in model.state_dict().items()}
    torch.save(local, f"{out}.{rank}")
    del model, optim, dl
    ray_mesh.shutdown_mesh()


if __name__ == "__main__":
    # fork: no thread has started in this process yet (torch starts its pools on first use)
    mode, args = ("diloco", sys.argv[2:]) if sys.argv[1] == "diloco" else ("hsdp", sys.argv[1:])
    steps = int(args[2]) if len(args) > 2 else STEPS
    ctx = mp.start_processes(rank_main, args=(mode, args[0], int(args[1]), steps),
                             nprocs=WORLD[mode], join=False, start_method="fork")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):  # True once all have ended; raises if one failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            sys.exit(f"reference ranks did not finish within {TIMEOUT_S} s")
