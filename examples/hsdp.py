"""HSDP with FSDP2 on a ray_mesh 2-D (dp_replicate, dp_shard) mesh.

The PyTorch DeviceMesh tutorial's HSDP toy model (FSDP HYBRID_SHARD on a (replicate, shard)
mesh), written with FSDP2's ``fully_shard``: parameters are sharded inside each dp_shard
group (a node) and replicated across dp_replicate groups (nodes). Trained on synthetic data
from a fixed "teacher" so the loss goes down.

    ray-mesh run examples/hsdp.yaml
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import ray_mesh


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def synthetic_batch(step: int, dp_rank: int, batch: int, device: torch.device):
    """A batch for (step, dp rank): the same on every tp/pp peer, different across dp."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(batch, 10, generator=g)
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(10, 5, generator=teacher)
    return x.to(device), (x @ w).tanh().to(device)


def train_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    device = ray_mesh.get_state().device
    steps, batch, lr = config.get("steps", 40), config.get("batch_size", 16), config.get("lr", 0.05)
    report_every = config.get("report_every", 10)

    torch.manual_seed(0)  # every rank starts from the same weights
    model = ToyModel().to(device)
    # HSDP: a 2-D mesh (replicate, shard) makes fully_shard shard on the inner dim and
    # replicate (all-reduce gradients) on the outer one.
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    optim = torch.optim.AdamW(model.parameters(), lr=lr)

    dp_rank = mesh["dp"].get_local_rank()
    for step in range(steps):
        x, y = synthetic_batch(step, dp_rank, batch, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if (step + 1) % report_every == 0 or step == 0 or step + 1 == steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg, group=mesh.get_group("dp"))
            avg = avg.item() / mesh["dp"].size()
            if dist.get_rank() == 0:
                print(f"hsdp: step {step + 1}/{steps} loss {avg:.4f}", flush=True)
            _report({"step": step + 1, "loss": avg})


def _report(metrics: dict) -> None:
    try:
        import ray.train
    except ImportError:  # under torchrun without Ray
        return
    ray.train.report(metrics)


if __name__ == "__main__":  # torchrun --nproc-per-node 4 examples/hsdp.py
    ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_replicate=2, dp_shard=-1))
    train_loop({"steps": 40})
    ray_mesh.shutdown_mesh()
