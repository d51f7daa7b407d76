"""Replica groups of unequal size: the run goes on when a group drops out, and each group
trains on a share of every step's samples sized to its speed.

    ray-mesh run examples/replica_groups.yaml        # embedded Ray: groups of 2 and 1 worker

Each replica group is its own Ray Train run with its own mesh (``dp_shard`` over its workers,
FSDP inside); at every step the groups average their gradients, weighted by the samples each
one trained on, so the update is the mean over the step's samples whatever the split. The
samples are numbered: ``rg.sample_ids`` gives this rank its part of its group's share, and
the run's quorum hands out every sample exactly once, also when a group leaves or rejoins.
See docs/replica_groups.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import ray_mesh
from ray_mesh import replica_group
from ray_mesh.parallel import parallelize

DIM, HIDDEN = 64, 512


def samples(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i`` is the same tensor in every run: a fixed function of a seeded input."""
    xs = torch.stack([torch.randn(DIM, generator=torch.Generator().manual_seed(i))
                      for i in ids])
    return xs, (xs[:, : DIM // 2] * 1.5).tanh()


def train_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    torch.manual_seed(0)  # every group starts from the same model
    model = parallelize(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(),
                                      nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                                      nn.Linear(HIDDEN, DIM // 2)), mesh)
    optim = torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=0.9)
    rg = replica_group(model, optim, config)  # joins the run: heals from a live group
    dp = mesh["dp_shard"]
    rg.commit()
    trained = 0  # the group's samples that went into a step: the summary's samples/s
    while rg.running:
        held = sum(n for _, n in rg.ranges)  # the group's share of this step's samples
        x, y = samples(rg.sample_ids(dp.get_local_rank(), dp.size()))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        before = rg.step
        rg.commit()  # average with the groups present, optimizer step
        if rg.step > before and rg.last.contributes:
            trained += held
        if rg.step % config.get("report_every", 5) == 0 or not rg.running:
            ray_mesh.report({"step": rg.step, "loss": float(loss.detach()),
                             "samples": trained, **rg.metrics()})
    rg.finish()
