"""Train function for the DiLoCo tests under Ray (loaded by path and shipped by value).

FSDP inside each replica (``dp=replicate_dp_mode()``), DiLoCo from the job's replicate
section (``wrap_replicate``), a :class:`Checkpointer` that saves each replica's state, and
deterministic data (a batch depends on the step and the replica). Test hooks, from the
config: rank 1 SIGKILLs itself at ``kill_at`` on the first attempt; rank 0 logs what it did
(start step, whether replicas were bitwise equal after each sync, metrics); at the end every
rank writes its local shards to ``<final>.<rank>`` for bitwise comparisons.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
import torch.nn as nn

import ray_mesh
from harness.ckpt_train import DILOCO_DROPOUT, batch, log_line, make_model
from ray_mesh.checkpointing import Checkpointer
from ray_mesh.parallel import parallelize, replicate_dp_mode, wrap_replicate
from ray_mesh.parallel.diloco import replicas_equal


def train_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    rank = torch.distributed.get_rank()
    model = parallelize(make_model(DILOCO_DROPOUT), mesh, dp=replicate_dp_mode())
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    dl = wrap_replicate(model, mesh)
    assert dl is not None, "the test runs with replicate: {mode: diloco}"
    ckpt = Checkpointer(model, optim, every=config["every"], diloco=dl,
                        resume_from=config.get("resume_from"))
    start = ckpt.restore()
    replica = mesh["dp_replicate"].get_local_rank()
    rep_group = mesh.get_group("dp_replicate")
    if rank == 0:
        log_line(config, f"start {start.step} {Path(start.path).name if start.path else '-'} "
                     f"replicas={dl.replicas} inner={dl.inner_steps} outer={dl.outer_steps}")
    if start.path and replica >= 2:  # a joining replica: warned, and given the global params
        assert any("not in checkpoint" in w for w in start.warnings), start.warnings
    for step in range(start.step, config["steps"]):
        x, y = batch(step, replica)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        synced = dl.step()
        done = step + 1
        equal = replicas_equal(model, rep_group) if synced else None
        kill = config.get("kill_at")
        if kill and done == kill and rank == 1 and not os.path.exists(config["kill_marker"]):
            Path(config["kill_marker"]).write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
        metrics = {"loss": loss.item(), **dl.metrics()}
        ckpt.report(done, metrics, data_position={"next_step": done})
        if rank == 0:
            log_line(config, f"step {done}" + (f" sync equal={equal}" if synced else "")
                 + f" metrics={json.dumps(metrics)}")
    dl.flush()  # nothing in flight without replicate.overlap; with it, the last sync lands
    ckpt.close()
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
             for k, v in model.state_dict().items()}
    torch.save(local, f"{config['final']}.{rank}")
