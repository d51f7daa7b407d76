"""Sharded checkpoints without Ray: 4 gloo processes, real FSDP2 / tensor parallel, real DCP.

One spawn of 4 ranks writes a checkpoint on a (dp_replicate=2, dp_shard=2) HSDP mesh, then
loads it on a (dp_shard=4) mesh and on a (dp_shard=2, tp=2) mesh and compares the full model
and optimizer state; it also checks the async writer and the mismatched-model error. The
partial/corrupt-directory checks then run on the directories it left behind.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from ports import free_port
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torchrun import spawn_ranks

from ray_mesh.checkpointing import sharded

WORLD = 4
TRAIN_STEPS = 3


def _model(hidden: int = 16, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 8))


def _full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    opts = StateDictOptions(full_state_dict=True)
    return {"model": sharded.full_model_state(model),
            "optim": get_optimizer_state_dict(model, optim, options=opts)["state"]}


def _assert_same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: tensors differ"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _checks(rank, Path(root))
    finally:
        dist.destroy_process_group()


def _checks(rank: int, root: Path) -> None:
    t0 = time.monotonic()
    group = sharded.checkpoint_group(timeout_s=120)

    # --- write on HSDP (dp_replicate=2 x dp_shard=2) after a few real steps
    mesh_a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model()
    fully_shard(model, mesh=mesh_a)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank // 2 + 1)
    for _ in range(TRAIN_STEPS):
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    reference = _full_state(model, optim)
    path_a = sharded.prepare_dir(root / "checkpoint_00000003", group)
    assert sharded.save(path_a, model, optim, group=group) is None
    sharded.mark_complete(path_a, sharded.Progress(TRAIN_STEPS, {"epoch": 0, "offset": 12}),
                          group=group, mesh={"dp_replicate": 2, "dp_shard": 2})
    # Each rank wrote its own shard file; rank 0 also the metadata and the marker.
    files = sorted(p.name for p in path_a.iterdir())
    assert sharded.MARKER in files and ".metadata" in files, files
    assert len([f for f in files if f.endswith(".distcp")]) >= 2, files

    # --- async writer: the Future completes and the result is a complete checkpoint
    path_async = sharded.prepare_dir(root / "checkpoint_00000002", group)
    future = sharded.save(path_async, model, optim, group=group, async_save=True)
    assert future is not None
    future.result(timeout=120)
    sharded.mark_complete(path_async, sharded.Progress(2), group=group)
    assert sharded.problem(path_async) is None

    # --- resharding: load onto (dp_shard=4) and onto (dp_shard=2, tp=2)
    for name, shape in (("fsdp4", (4,)), ("tp2xfsdp2", (2, 2))):
        if name == "fsdp4":
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_shard",))
            other = _model(seed=123)
            fully_shard(other, mesh=mesh)
        else:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_shard", "tp"))
            other = _model(seed=123)
            parallelize_module(other, mesh["tp"], {"0": ColwiseParallel(),
                                                   "2": RowwiseParallel()})
            fully_shard(other, mesh=mesh["dp_shard"])
        other_optim = torch.optim.AdamW(other.parameters(), lr=0.05)
        before = sharded.full_model_state(other)
        assert not torch.equal(before["0.weight"], reference["model"]["0.weight"])
        progress = sharded.load(path_a, other, other_optim, group=group)
        assert progress.step == TRAIN_STEPS
        assert progress.data_position == {"epoch": 0, "offset": 12}
        assert progress.mesh == {"dp_replicate": 2, "dp_shard": 2}
        _assert_same(reference, _full_state(other, other_optim), name)

    # --- a different model: a clear error naming the keys, on every rank, no hang
    odd = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 8))
    with pytest.raises(sharded.CheckpointMismatchError) as err:
        sharded.load(path_a, odd, group=group)
    msg = str(err.value)
    assert "3.weight" in msg and "3.bias" in msg, msg
    assert "0.weight: checkpoint (16, 8), model (32, 8)" in msg, msg
    dist.barrier()
    if rank == 0:
        print(f"4-rank checks took {time.monotonic() - t0:.1f} s", flush=True)



def test_save_reshard_async_and_mismatch(tmp_path):
    spawn_ranks(_worker, (free_port(), str(tmp_path)), WORLD, 240, "4-rank checkpoint test")

    # Partial and corrupt directories, found by the checker and skipped in favour of the
    # previous complete one, each with a reason.
    good = tmp_path / "checkpoint_00000003"
    assert sharded.problem(good) is None
    no_marker = tmp_path / "checkpoint_00000006"
    shutil.copytree(good, no_marker)
    (no_marker / sharded.MARKER).unlink()
    truncated = tmp_path / "checkpoint_00000009"
    shutil.copytree(good, truncated)
    shard = sorted(truncated.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:10])
    missing = tmp_path / "checkpoint_00000012"
    shutil.copytree(good, missing)
    sorted(missing.glob("*.distcp"))[0].unlink()

    assert "no ray_mesh_checkpoint.json" in sharded.problem(no_marker)
    assert "truncated" in sharded.problem(truncated)
    assert "missing" in sharded.problem(missing)
    assert sharded.older_siblings(missing) == [truncated, no_marker, good,
                                               tmp_path / "checkpoint_00000002"]
    chosen, warnings = sharded.newest_complete([missing, *sharded.older_siblings(missing)])
    assert chosen == str(good)
    assert len(warnings) == 3
    assert all(str(p) in w for p, w in zip([missing, truncated, no_marker], warnings,
                                           strict=True))
