"""HSDP with FSDP2 on a ray_mesh 2-D (dp_replicate, dp_shard) mesh.

The PyTorch DeviceMesh tutorial's HSDP toy model (FSDP HYBRID_SHARD on a (replicate, shard)
mesh), written with ``ray_mesh.parallel.parallelize``: the mesh's dp dims pick the layout, so
with dp_replicate=2 x dp_shard=2 the parameters are sharded inside each dp_shard group (a
node) and replicated across dp_replicate groups (nodes). Trained on synthetic data from a
fixed "teacher" so the loss goes down.

    ray-mesh run examples/hsdp.yaml
    torchrun --nproc-per-node 4 examples/hsdp.py
"""

from __future__ import annotations

import torch
import torch.nn as nn

import ray_mesh
from ray_mesh import report_due, report_progress
from ray_mesh.parallel import dp_mean, dp_size, parallelize, shard_batch

# batch_size is per dp replica (the global batch is batch_size x dp).
DEFAULTS = {"steps": 40, "batch_size": 16, "lr": 0.05, "report_every": 10, "seed": 0,
            "mixed_precision": None}


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def make_model(config: dict | None = None) -> nn.Module:
    """The model, the same on every rank (one seed); also the single-process reference."""
    torch.manual_seed({**DEFAULTS, **(config or {})}["seed"])
    return ToyModel()


def synthetic_batch(step: int, dp_rank: int, batch: int, device: torch.device):
    """A batch for (step, dp rank): the same on every tp/pp peer, different across dp."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(batch, 10, generator=g)
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(10, 5, generator=teacher)
    return x.to(device), (x @ w).tanh().to(device)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int, config: dict | None = None, replicas: int = 1,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` for ``replicas`` dp ranks: replica r's rows are
    ``synthetic_batch(step, r)``, so ``shard_batch`` hands each replica its own batch."""
    cfg = {**DEFAULTS, **(config or {})}
    parts = [synthetic_batch(step, r, cfg["batch_size"], torch.device("cpu"))
             for r in range(replicas)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def build(mesh, config: dict | None = None) -> nn.Module:
    """The model with data parallel as the mesh's dp dims say (HSDP on a 2 x 2 mesh)."""
    cfg = {**DEFAULTS, **(config or {})}
    # net1 and net2 each get their own fully_shard group, then the root.
    return parallelize(make_model(cfg), mesh, blocks=lambda name, _: name in ("net1", "net2"),
                       mixed_precision=cfg["mixed_precision"])


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, mesh) -> torch.Tensor:
    """One step on this replica's share of the global batch (by dp rank, never world rank);
    returns the loss averaged over the dp replicas."""
    device = next(model.parameters()).device
    x, y = shard_batch((x, y), mesh)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return dp_mean(loss, mesh)


def train_loop(config: dict) -> None:
    cfg = {**DEFAULTS, **(config or {})}
    mesh = ray_mesh.get_mesh()
    steps = cfg["steps"]
    model = build(mesh, cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    for step in range(steps):
        avg = train_step(model, optim, *batch(step, cfg, dp_size(mesh)), mesh).item()
        if report_due(step, steps, cfg["report_every"]):
            report_progress("hsdp", {"step": step + 1, "loss": avg,
                            "samples": (step + 1) * cfg["batch_size"] * dp_size(mesh)}, steps)


if __name__ == "__main__":  # torchrun --nproc-per-node 4 examples/hsdp.py
    ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_replicate=2, dp_shard=-1))
    train_loop({"steps": 40})
    ray_mesh.shutdown_mesh()
