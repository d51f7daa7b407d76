"""3-D parallel: pipeline x data (HSDP) x tensor parallel on 8 workers.

An 8-layer MLP (width 64) cut into 4 pipeline stages of 2 layers, 2 stages per pp rank, run
by the interleaved 1F1B schedule. Inside a stage the first layer is split colwise and the
second rowwise over tp; each stage is then sharded over the data-parallel dims. The mesh is
``layout: hsdp`` with pp=2, tp=2: across nodes dp_replicate is the node count and dp_shard
takes the rest, so on one machine (8 CPU workers) it is pp 2 x dp_shard 2 x tp 2, and on two
8-GPU nodes pp 2 x dp_replicate 2 x dp_shard 2 x tp 2, with no change to this file.

    ray-mesh run examples/pp_hsdp_tp.yaml                   # 8 CPU workers, gloo
    torchrun --nproc-per-node 8 examples/pp_hsdp_tp.py

``make_model``/``build``/``batch``/``train_step`` are importable for benchmarks and tests.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

import ray_mesh
from ray_mesh import report_due, report_progress
from ray_mesh.parallel import Pipeline, dp_mean, local_batch_size, shard_batch

WIDTH, IN, OUT, LAYERS = 64, 32, 8, 8
DEFAULTS = {"steps": 30, "batch_size": 32, "microbatches": 4, "schedule": "interleaved_1f1b",
            "stages_per_rank": 2, "lr": 0.01, "seed": 0, "report_every": 10,
            "mixed_precision": None}


class Dense(nn.Module):
    def __init__(self, d_in: int, d_out: int, act: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.linear(x))


def make_model(config: dict | None = None) -> nn.Sequential:
    """fc1..fc8, the same on every rank (one seed); also the single-process reference."""
    cfg = {**DEFAULTS, **(config or {})}
    torch.manual_seed(cfg["seed"])
    dims = [IN] + [WIDTH] * (LAYERS - 1) + [OUT]
    return nn.Sequential(OrderedDict(
        (f"fc{i + 1}", Dense(dims[i], dims[i + 1], act=i + 1 < LAYERS)) for i in range(LAYERS)))


# Odd layers colwise, even layers rowwise: one all-reduce per pair, and every stage holds a
# whole pair, so activations cross stage boundaries whole.
TP_PLAN = {f"fc{i}.linear": "colwise" if i % 2 else "rowwise" for i in range(1, LAYERS + 1)}


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a dataset of 4 batches, seen in turn, from a teacher."""
    cfg = {**DEFAULTS, **(config or {})}
    g = torch.Generator().manual_seed(30_000 + step % 4)
    x = torch.randn(cfg["batch_size"], IN, generator=g)
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(2))
    return x, torch.tanh(x @ teacher / IN ** 0.5)


def build(mesh, config: dict | None = None) -> Pipeline:
    """This rank's stages (TP, then HSDP/FSDP per stage) and the pipeline schedule."""
    cfg = {**DEFAULTS, **(config or {})}
    return Pipeline(make_model(cfg), mesh, loss_fn=loss_fn, n_microbatches=cfg["microbatches"],
                    schedule=cfg["schedule"], stages_per_rank=cfg["stages_per_rank"],
                    tp_plan=TP_PLAN, mixed_precision=cfg["mixed_precision"],
                    batch_size=local_batch_size(cfg["batch_size"], mesh))


def train_step(pipe: Pipeline, optim: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, mesh) -> torch.Tensor:
    """One step on this replica's share of the global batch; returns the global mean loss."""
    x, y = shard_batch((x, y), mesh)
    loss = pipe.step(x.to(pipe.device), target=y.to(pipe.device))
    optim.step()
    optim.zero_grad()
    return dp_mean(loss, mesh)


def train_loop(config: dict) -> None:
    cfg = {**DEFAULTS, **(config or {})}
    mesh = ray_mesh.get_mesh()
    pipe = build(mesh, cfg)
    optim = torch.optim.AdamW(pipe.parameters(), lr=cfg["lr"])
    for step in range(cfg["steps"]):
        loss = train_step(pipe, optim, *batch(step, cfg), mesh).item()
        if report_due(step, cfg["steps"], cfg["report_every"]):
            report_progress("pp_hsdp_tp", {"step": step + 1, "loss": loss}, cfg["steps"])


if __name__ == "__main__":
    ray_mesh.init_mesh(ray_mesh.MeshSpec.hsdp(pp=2, tp=2))
    train_loop({})
    ray_mesh.shutdown_mesh()
