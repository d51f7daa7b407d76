"""Train function for the Ray Data mesh tests: every rank logs the row ids of every step.

Each step reads one batch from the Ray Data shard (``ray.train.get_dataset_shard("train")``,
a ``ray.data.range`` of row ids) and one from a torch ``DataLoader`` over the same ids with a
dp-rank sampler, and appends them to ``<out>/rank<R>.jsonl``. ``resumable: True`` wraps both
for exact resumes (``ResumableShard``, ``resumable_sampler``) and checkpoints with
``Checkpointer``; rank 1 can SIGKILL itself at ``kill_at`` on the first attempt.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import ray.train
import torch
from torch.utils.data import DataLoader

import ray_mesh
from ray_mesh.parallel import distributed_sampler, dp_rank, resumable_sampler


def train_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    rank = torch.distributed.get_rank()
    rows, batch, epochs = config["rows"], config["batch"], config["epochs"]
    shard = ray.train.get_dataset_shard("train")
    ckpt, step, position = None, 0, {}
    if config.get("resumable"):
        from ray_mesh.checkpointing import Checkpointer
        from ray_mesh.raytrain.data import ResumableShard

        model = torch.nn.Linear(2, 1)
        ckpt = Checkpointer(model, every=config["every"])
        start = ckpt.restore()
        step, position = start.step, start.data_position
        shard = ResumableShard(shard, position.get("ray"))
        sampler = resumable_sampler(rows, mesh, position.get("torch"), shuffle=True, seed=3)
    else:
        sampler = distributed_sampler(range(rows), mesh, shuffle=True, seed=3)
    loader = DataLoader(range(rows), batch_size=batch, sampler=sampler)
    attempt = step
    out = Path(config["out"]) / f"rank{rank}.jsonl"
    for epoch in range(int(position.get("ray", {}).get("epoch", 0)), epochs):
        sampler.set_epoch(epoch)
        for ray_batch, torch_batch in zip(shard.iter_torch_batches(batch_size=batch), loader,
                                          strict=False):
            step += 1
            record = {"rank": rank, "dp": dp_rank(mesh), "step": step, "epoch": epoch,
                      "attempt": attempt, "ray": ray_batch["id"].tolist(),
                      "torch": torch_batch.tolist()}
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if ckpt is None:
                continue
            sampler.advance(len(torch_batch))
            if (step == config.get("kill_at") and rank == 1
                    and not os.path.exists(config["kill_marker"])):
                # Rank 0 waits until Ray registered the last checkpoint, rank 1 does not:
                # without this wait the resume may start from the one before.
                ray.train.get_all_reported_checkpoints(
                    consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
                    timeout_s=120)
                Path(config["kill_marker"]).write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.report(step, data_position={"ray": shard.position(),
                                             "torch": sampler.position()})
    if ckpt is not None:
        ckpt.close()


def read_records(out: Path) -> list[dict]:
    """Every rank's records, in the order written."""
    return [json.loads(line) for p in sorted(out.glob("rank*.jsonl"))
            for line in p.read_text().splitlines()]
