"""Random state, checksums and the NaN guard across 2 gloo ranks (FSDP2, real DCP).

* A run with dropout (and draws from Python ``random`` and NumPy) that saves at step 3 and
  resumes from it -- after re-seeding and rebuilding the model as a restarted process does --
  ends bitwise equal to the uninterrupted run; resuming without the random state does not.
* The manifest lists every rank's files; a byte flipped in the middle of rank 1's shard is
  named and the previous checkpoint chosen.
* NaN on one rank only: every rank raises NonFiniteError (no rank hangs in the save).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from ports import free_port
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torchrun import spawn_ranks

import ray_mesh
from ray_mesh.checkpointing import integrity, sharded

WORLD = 2
STEPS = 6
SAVE_AT = 3


def _seed_and_build(rank: int, mesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    """What a (re)started training process does first: seed, build, shard."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 4))
    fully_shard(model, mesh=mesh)
    torch.manual_seed(100 + rank)  # per-rank streams (dropout masks differ between ranks)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model, optim, rank: int, steps: range) -> None:
    for step in steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        scale = 1.0 + random.random() + float(np.random.rand())
        (model(x).pow(2).mean() * scale).backward()
        optim.step()
        optim.zero_grad()


def _checks(rank: int, root: Path) -> None:
    group = sharded.checkpoint_group(timeout_s=120)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))

    model, optim = _seed_and_build(rank, mesh)
    _train(model, optim, rank, range(STEPS))
    reference = sharded.full_model_state(model)

    model, optim = _seed_and_build(rank, mesh)
    _train(model, optim, rank, range(SAVE_AT))
    path = sharded.prepare_dir(root / sharded.dir_name(SAVE_AT), group)
    sharded.save(path, model, optim, group=group)
    sharded.mark_complete(path, sharded.Progress(SAVE_AT), group=group)

    for restore_rng in (True, False):
        model, optim = _seed_and_build(rank, mesh)
        progress = sharded.load(path, model, optim, group=group, restore_rng=restore_rng)
        assert progress.step == SAVE_AT and progress.warnings == []
        _train(model, optim, rank, range(progress.step, STEPS))
        resumed = sharded.full_model_state(model)
        same = all(torch.equal(reference[k], resumed[k]) for k in reference)
        assert same == restore_rng, f"restore_rng={restore_rng}: bitwise equal={same}"

    # A later checkpoint, for the corruption check the test does after the ranks exit.
    later = sharded.prepare_dir(root / sharded.dir_name(STEPS), group)
    sharded.save(later, model, optim, group=group)
    sharded.mark_complete(later, sharded.Progress(STEPS), group=group)

    # NaN on rank 1 only: both ranks refuse, neither hangs in DCP's collectives.
    if rank == 1:
        with torch.no_grad():
            next(iter(model.parameters())).to_local().view(-1)[0] = float("nan")
    nan_dir = sharded.prepare_dir(root / sharded.dir_name(STEPS + 1), group)
    with pytest.raises(sharded.NonFiniteError) as err:
        sharded.save(nan_dir, model, optim, group=group)
    assert ("on this rank" if rank == 1 else "another rank") in str(err.value)
    dist.barrier()


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _checks(rank, Path(root))
    finally:
        # Not dist.destroy_process_group() alone: the FSDP models and the mesh of _checks are
        # unreachable cycles that keep both gloo groups, and their worker threads, alive
        # until interpreter exit, where a worker can abort the rank (SIGABRT, "terminate
        # called without an active exception"; see ray_mesh.core.teardown). shutdown_mesh()
        # also collects them, so every group is freed here.
        ray_mesh.shutdown_mesh()



def test_rng_resume_checksums_and_nan_guard(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, 240, "2-rank checkpoint test")

    older, newer = tmp_path / sharded.dir_name(SAVE_AT), tmp_path / sharded.dir_name(STEPS)
    files = json.loads((newer / integrity.MANIFEST).read_text())["files"]
    assert set(files) == {".metadata", "__0_0.distcp", "__1_0.distcp", "rng_rank0.json",
                          "rng_rank1.json"}, files
    assert sharded.newest_complete([newer, older]) == (str(newer), [])
    shard = newer / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    chosen, warnings = sharded.newest_complete([newer, older])
    assert chosen == str(older)
    assert "__1_0.distcp is corrupt" in warnings[0] and str(newer) in warnings[0], warnings
    # The refused NaN save left an unmarked directory: never a complete checkpoint.
    assert "no ray_mesh_checkpoint.json" in sharded.problem(tmp_path / sharded.dir_name(STEPS + 1))
