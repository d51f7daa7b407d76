"""HSDP toy training with ray_mesh metrics: what a monitored run looks like.

The loop only calls ``ray_mesh.report`` (``ray.train.report`` plus ray_mesh's bookkeeping)
every ``report_every`` steps, with the step, the loss and the samples seen so far. ray_mesh
reads those reports: rank 0's progress line on the console, and step time, steps/s,
samples/s, loss and memory in Ray's metrics with this rank's mesh coordinate as tags
(``ray_mesh.observability.metrics``); the wait sampler adds each dim's wait share with no
code here. ``probe_dims`` measures every mesh dim's all-reduce once at start. Rank 0 saving
the mesh layout next to the results is done by the backend.

    ray-mesh run examples/hsdp_metrics.yaml
    ray-mesh status            # in another shell, while it runs
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import ray_mesh
from ray_mesh import probe_dims


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))


def _batch(step: int, dp_rank: int, batch: int, device: torch.device):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(batch, 32, generator=g)
    w = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    return x.to(device), (x @ w).tanh().to(device)


def train_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    device = ray_mesh.get_state().device
    steps, batch = int(config.get("steps", 60)), int(config.get("batch_size", 16))
    report_every = int(config.get("report_every", 10))
    step_sleep_s = float(config.get("step_sleep_s", 0.0))  # stretch a toy step for demos
    stop_file = config.get("stop_file")  # end early once this file exists (demos, tests)

    torch.manual_seed(0)
    model = _model().to(device)
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    optim = torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 0.02)))

    probe_dims()  # each dim's all-reduce latency and bandwidth, once

    # dp_rank/dp_size read the flattened dp dim ray_mesh keeps (no root-mesh slicing).
    dp_rank, dp_group = ray_mesh.parallel.dp_rank(mesh), mesh.get_group("dp")
    dp = ray_mesh.parallel.dp_size(mesh)
    for step in range(steps):
        x, y = _batch(step, dp_rank, batch, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step_sleep_s:
            time.sleep(step_sleep_s)
        last = step + 1 == steps
        if step == 0 or (step + 1) % report_every == 0 or last:
            avg = loss.detach().clone()
            dist.all_reduce(avg, group=dp_group)
            # Same decision on every rank (a collective), so all ranks stop together.
            flag = float(bool(stop_file) and os.path.exists(stop_file))
            stop = torch.tensor(flag, device=device)
            dist.all_reduce(stop)
            ray_mesh.report({"step": step + 1, "loss": avg.item() / dp,
                             "samples": (step + 1) * batch * dp})
            if stop.item():
                break
