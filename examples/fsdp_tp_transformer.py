"""A small transformer with 2-D FSDP + TP, sequence parallel on the norms.

torchtitan's layout for a Llama-style block: attention q/k/v and the MLP's first layer split
colwise (heads / hidden units), the output projections rowwise with their result
reduce-scattered onto the sequence, and the LayerNorms run on a sequence shard (sequence
parallel) so activations between blocks are 1/tp the size. Then FSDP2 shards every block,
the embedding and the head over ``dp_shard_cp``. The token data is sharded by dp rank.

    ray-mesh run examples/fsdp_tp_transformer.yaml          # 4 CPU workers: dp_shard 2 x tp 2
    torchrun --nproc-per-node 4 examples/fsdp_tp_transformer.py

``make_model``/``build``/``batch``/``train_step``/``make_step`` are importable for benchmarks
and tests; ``make_step`` is also what ``mesh: auto`` times (``plan.step``).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import ray_mesh
from ray_mesh import report_due, report_progress
from ray_mesh.parallel import ParallelError, Pipeline, dp_mean, parallelize, shard_batch

# TP hands FSDP2 the local view of its DTensor outputs (embedding, head); FSDP2 warns that an
# in-place op on such a view would skip its hook. This model adds out of place only.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

DEFAULTS = {"vocab": 64, "dim": 32, "heads": 4, "layers": 2, "ffn": 64, "seq": 16,
            "batch_size": 8, "steps": 30, "lr": 0.01, "seed": 0, "report_every": 10,
            "mixed_precision": None}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: the heads this rank holds (all of them without TP, heads/tp with it).
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


def make_model(config: dict | None = None) -> nn.Sequential:
    """Embedding, blocks, head as one flat ``nn.Sequential`` (so pipeline stages can cut it)."""
    cfg = {**DEFAULTS, **(config or {})}
    torch.manual_seed(cfg["seed"])
    layers: list[tuple[str, nn.Module]] = [("tok_embeddings", nn.Embedding(cfg["vocab"],
                                                                           cfg["dim"]))]
    layers += [(f"layer{i}", Block(cfg["dim"], cfg["heads"], cfg["ffn"]))
               for i in range(cfg["layers"])]
    layers.append(("head", Head(cfg["dim"], cfg["vocab"])))
    return nn.Sequential(OrderedDict(layers))


def tp_plan() -> dict:
    """torchtitan's Llama plan with sequence parallel, for the module paths of ``make_model``."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layer*.attention_norm": SequenceParallel(),
        "layer*.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
        "layer*.attention.wq": ColwiseParallel(),
        "layer*.attention.wk": ColwiseParallel(),
        "layer*.attention.wv": ColwiseParallel(),
        "layer*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layer*.ffn_norm": SequenceParallel(),
        "layer*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                  desired_input_layouts=(Replicate(),)),
        "layer*.feed_forward.w1": ColwiseParallel(),
        "layer*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "head.norm": SequenceParallel(),
        "head.output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def check_config(cfg: dict, tp: int) -> None:
    """What the plan needs beyond even layer splits: whole heads and an even sequence split."""
    if cfg["heads"] % tp:
        raise ParallelError(f"fsdp_tp_transformer: heads={cfg['heads']} do not split over "
                            f"tp={tp}; use a tp that divides the number of heads.")
    if cfg["seq"] % tp:
        raise ParallelError(f"fsdp_tp_transformer: sequence parallel splits seq={cfg['seq']} "
                            f"over tp={tp}; use a sequence length that is a multiple of {tp}.")


def loss_fn(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten(0, 1))


def batch(step: int, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a learnable sequence (each token = previous + 1, mod V)."""
    cfg = {**DEFAULTS, **(config or {})}
    g = torch.Generator().manual_seed(20_000 + step)
    start = torch.randint(0, cfg["vocab"], (cfg["batch_size"], 1), generator=g)
    seq = (start + torch.arange(cfg["seq"] + 1)) % cfg["vocab"]
    return seq[:, :-1], seq[:, 1:]


def build(mesh, config: dict | None = None) -> nn.Module:
    """TP (with sequence parallel) on ``tp``, then FSDP2 per layer on ``dp_shard_cp``."""
    cfg = {**DEFAULTS, **(config or {})}
    check_config(cfg, mesh["tp"].size())
    return parallelize(make_model(cfg), mesh, tp_plan=tp_plan(),
                       mixed_precision=cfg["mixed_precision"])


def train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor, mesh) -> torch.Tensor:
    """One step on this replica's share of the global batch; returns the global mean loss."""
    device = next(model.parameters()).device
    x, y = shard_batch((x, y), mesh)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return dp_mean(loss, mesh)


def make_step(mesh, config: dict | None = None):
    """One training step on ``mesh`` with a fixed batch: ``mesh: auto``'s ``plan.step``
    (each candidate layout timed at bring-up). TP where the mesh has tp, a GPipe pipeline
    (``microbatches``, default 4) where it has pp, FSDP2/DDP over the data-parallel dims in
    the gradient precision the trial sets (``mixed_precision`` left unset)."""
    cfg = {**DEFAULTS, **(config or {})}
    tp = mesh["tp"].size()
    check_config(cfg, tp)
    x, y = batch(0, cfg)
    if mesh["pp"].size() > 1:  # the model is a flat nn.Sequential: the stages cut it
        pipe = Pipeline(make_model(cfg), mesh, loss_fn=loss_fn,
                        n_microbatches=cfg.get("microbatches", 4), schedule="gpipe",
                        tp_plan=tp_plan() if tp > 1 else None,
                        mixed_precision=cfg["mixed_precision"])
        optim = torch.optim.SGD(list(pipe.parameters()), lr=cfg["lr"])
        xs, ys = shard_batch((x, y), mesh)

        def pipeline_step() -> None:
            pipe.step(xs, target=ys)
            optim.step()
            optim.zero_grad()
        return pipeline_step
    model = parallelize(make_model(cfg), mesh, tp_plan=tp_plan() if tp > 1 else None,
                        mixed_precision=cfg["mixed_precision"])
    optim = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    return lambda: train_step(model, optim, x, y, mesh)


def train_loop(config: dict) -> None:
    cfg = {**DEFAULTS, **(config or {})}
    mesh = ray_mesh.get_mesh()
    model = build(mesh, cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    for step in range(cfg["steps"]):
        loss = train_step(model, optim, *batch(step, cfg), mesh).item()
        if report_due(step, cfg["steps"], cfg["report_every"]):
            report_progress("fsdp_tp_transformer", {"step": step + 1, "loss": loss}, cfg["steps"])


if __name__ == "__main__":
    ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_replicate=1, dp_shard=-1, tp=2))
    train_loop({})
    ray_mesh.shutdown_mesh()
