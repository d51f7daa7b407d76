"""The "2D Parallelism using Ray PyTorch" blog model: 2 pipeline stages x 2 TP ranks.

Four linear layers (50x50, 50x50, 50x50, 50x4) with ReLUs, batch 32. Stage 0 holds fc1, fc2
and stage 1 holds fc3, fc4; inside a stage the first layer is split colwise and the second
rowwise over tp, so each stage costs one all-reduce and passes a whole activation on. In the
blog this is 2 nodes x 2 GPUs; ray_mesh sets the network variables, builds the
(pp, dp_replicate, dp_shard, cp, tp) mesh and keeps tp inside a node.

    ray-mesh run examples/tp_pp_mlp.yaml                     # 4 CPU workers, gloo
    torchrun --nproc-per-node 4 examples/tp_pp_mlp.py

It prints the final output shape (32, 4) on the last stage and trains on a fixed teacher, so
the loss goes down. ``make_model``/``build``/``batch``/``train_step`` are importable for
benchmarks and tests.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

import ray_mesh
from ray_mesh import report_due, report_progress
from ray_mesh.parallel import Pipeline, dp_mean, dp_rank, dp_size, local_batch_size

IN, HIDDEN, OUT = 50, 50, 4
TP_PLAN = {"fc1.linear": "colwise", "fc2.linear": "rowwise",
           "fc3.linear": "colwise", "fc4.linear": "rowwise"}
DEFAULTS = {"steps": 30, "batch_size": 32, "microbatches": 4, "schedule": "1f1b", "lr": 0.01,
            "seed": 0, "report_every": 10}


class Dense(nn.Module):
    """Linear, then ReLU unless it is the output layer."""

    def __init__(self, d_in: int, d_out: int, act: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def make_model(config: dict | None = None) -> nn.Sequential:
    """The whole model, the same on every rank (one seed); also the single-process reference."""
    cfg = {**DEFAULTS, **(config or {})}
    torch.manual_seed(cfg["seed"])
    return nn.Sequential(OrderedDict(
        fc1=Dense(IN, HIDDEN), fc2=Dense(HIDDEN, HIDDEN),
        fc3=Dense(HIDDEN, HIDDEN), fc4=Dense(HIDDEN, OUT, act=False)))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs and the outputs of a fixed random teacher."""
    cfg = {**DEFAULTS, **(config or {})}
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(cfg["batch_size"], IN, generator=g)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1))
    return x, torch.tanh(x @ teacher / IN ** 0.5)


def build(mesh, config: dict | None = None) -> Pipeline:
    """This rank's stages: TP by ``TP_PLAN`` then data parallel, scheduled along ``pp``."""
    cfg = {**DEFAULTS, **(config or {})}
    return Pipeline(make_model(cfg), mesh, loss_fn=loss_fn, n_microbatches=cfg["microbatches"],
                    schedule=cfg["schedule"], tp_plan=TP_PLAN,
                    batch_size=local_batch_size(cfg["batch_size"], mesh))


def train_step(pipe: Pipeline, optim: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, mesh) -> torch.Tensor:
    """One step on this replica's share of the global batch; returns the global mean loss."""
    per = x.shape[0] // dp_size(mesh)
    lo = dp_rank(mesh) * per
    loss = pipe.step(x[lo:lo + per].to(pipe.device), target=y[lo:lo + per].to(pipe.device))
    optim.step()
    optim.zero_grad()
    return dp_mean(loss, mesh)


def train_loop(config: dict) -> None:
    cfg = {**DEFAULTS, **(config or {})}
    mesh = ray_mesh.get_mesh()
    pipe = build(mesh, cfg)
    optim = torch.optim.AdamW(pipe.parameters(), lr=cfg["lr"])
    coord = f"pp {mesh['pp'].get_local_rank()} tp {mesh['tp'].get_local_rank()}"
    for step in range(cfg["steps"]):
        loss = train_step(pipe, optim, *batch(step, cfg), mesh).item()
        if report_due(step, cfg["steps"], cfg["report_every"]):
            report_progress("tp_pp_mlp", {"step": step + 1, "loss": loss}, cfg["steps"])
    x, _ = batch(cfg["steps"], cfg)
    out = pipe.forward_only(x[:local_batch_size(cfg["batch_size"], mesh)].to(pipe.device))
    if out is not None:
        print(f"tp_pp_mlp: {coord} (last stage): final output shape {tuple(out.shape)}, "
              f"mean {out.float().mean().item():+.4f}", flush=True)


if __name__ == "__main__":
    ray_mesh.init_mesh(ray_mesh.MeshSpec(pp=2, dp_replicate=1, dp_shard=-1, tp=2))
    train_loop({})
    ray_mesh.shutdown_mesh()
