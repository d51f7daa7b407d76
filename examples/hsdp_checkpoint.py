"""HSDP training that survives failures: sharded checkpoints, resume, resharding.

Every ``checkpoint_every`` steps each rank writes its own shards of model and optimizer
state (torch.distributed.checkpoint) into ``<storage_path>/<name>/checkpoint_<step>_<tag>``;
once all ranks are done, rank 0 marks it complete and Ray Train records it
(``CheckpointConfig(num_to_keep)`` in the job's ``run:``). When a worker dies, Ray Train
restarts the group (``run.max_failures``) and ``Checkpointer.restore()`` continues from the
newest complete checkpoint, on whatever mesh the restarted run has.

    ray-mesh run examples/hsdp_checkpoint.yaml            # train; kill a worker, it resumes
    ray-mesh run examples/hsdp_checkpoint.yaml            # again: resumes the finished run
    # another mesh from the same checkpoint: config.resume_from=<checkpoint dir>, new name

The data position is the step: a batch depends only on (step, dp rank), so a resumed run
sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import ray_mesh
from ray_mesh.checkpointing import Checkpointer
from ray_mesh.parallel import dp_rank, dp_size, parallelize

DEFAULTS = {"steps": 40, "batch_size": 16, "lr": 0.05, "checkpoint_every": 10,
            "async_save": False, "resume_from": None}


def synthetic_batch(step: int, rank: int, batch: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch, 10, generator=g)
    w = torch.randn(10, 5, generator=torch.Generator().manual_seed(0))
    return x.to(device), (x @ w).tanh().to(device)


def train_loop(config: dict) -> None:
    cfg = {**DEFAULTS, **(config or {})}
    mesh = ray_mesh.get_mesh()
    device = ray_mesh.get_state().device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    model = parallelize(model, mesh)  # FSDP / HSDP / DDP as the mesh's dp dims say
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])

    ckpt = Checkpointer(model, optim, every=cfg["checkpoint_every"],
                        async_save=cfg["async_save"], resume_from=cfg["resume_from"])
    start = ckpt.restore()  # Progress(step=0) on a fresh run
    if dist.get_rank() == 0:
        print(f"hsdp_checkpoint: starting at step {start.step}"
              + (f" from {start.path} (written on {start.mesh})" if start.path else ""),
              flush=True)

    rank = dp_rank(mesh)
    for step in range(start.step, cfg["steps"]):
        x, y = synthetic_batch(step, rank, cfg["batch_size"], device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=mesh.get_group("dp"))
        done = step + 1
        # Every rank, every step: reports the metrics, and the checkpoint when one is due.
        ckpt.report(done, {"loss": avg.item() / dp_size(mesh)},
                    data_position={"next_step": done}, save=done == cfg["steps"] or None)
    ckpt.close()  # an async save still in flight is finished and reported here
