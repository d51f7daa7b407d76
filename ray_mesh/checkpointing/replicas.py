"""Sharded checkpoints of a DiLoCo run: each replica's own state, the outer state once.

Between DiLoCo syncs the replicas hold different parameters and inner optimizer states, and
DCP keeps one copy of chunks that several ranks hold at the same offsets: a plain
:func:`ray_mesh.checkpointing.sharded.save` would keep replica 0's and drop the others. So
the state is laid out as :meth:`ray_mesh.parallel.diloco.DiLoCo.checkpoint_state` says
(``replica<r>.model``, ``replica<r>.optim``, ``diloco.*``), with the same marker, manifest,
random state and checks as every other ray_mesh checkpoint. A replica the checkpoint does
not hold (more nodes than at the save) starts from the global parameters.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ray_mesh.checkpointing import rng
from ray_mesh.checkpointing.safe_load import load_state
from ray_mesh.checkpointing.sharded import (
    Optimizers,
    Progress,
    _check_finite,
    _optims,
    _rank,
    checked_for_load,
    read_progress,
)
from ray_mesh.errors import CheckpointMismatchError
from ray_mesh.parallel.diloco import DiLoCo


def save(path: str | os.PathLike, diloco: DiLoCo, model: torch.nn.Module,
         optimizers: Optimizers = None, *, group: dist.ProcessGroup | None = None,
         async_save: bool = False, check_finite: bool = True) -> Future | None:
    """:func:`ray_mesh.checkpointing.sharded.save` for a model under DiLoCo."""
    if check_finite:
        _check_finite(model, group)
    rng.save(Path(path), _rank(group))
    state, _ = diloco.checkpoint_state(model, _optims(optimizers))
    if async_save:
        return dcp.async_save(state, checkpoint_id=str(path), process_group=group)
    dcp.save(state, checkpoint_id=str(path), process_group=group)
    return None


def load(path: str | os.PathLike, diloco: DiLoCo, model: torch.nn.Module,
         optimizers: Optimizers = None, *, group: dist.ProcessGroup | None = None,
         verify: bool = True) -> Progress:
    """:func:`ray_mesh.checkpointing.sharded.load` for a model under DiLoCo.

    ``Progress.warnings`` says so when this replica was not in the checkpoint.
    """
    path = Path(path)
    meta = checked_for_load(path, verify)
    saved = meta.state_dict_metadata
    if not any(k.startswith("diloco.") for k in saved):
        raise CheckpointMismatchError(
            f"Checkpoint {path} was not written by a DiLoCo run (no 'diloco' state): resume it "
            f"with replicate mode sync, or start this DiLoCo run in a new run directory.")
    optims = _optims(optimizers)
    state, mine = diloco.checkpoint_state(model, optims, saved)
    load_state(path, state, meta, group, verified=verify)
    diloco.apply_checkpoint_state(state, model, optims, mine)
    progress = read_progress(path)
    progress.warnings += rng.load(path, _rank(group))
    if not mine:
        progress.warnings.append(
            f"replica {diloco._replica_key()} is not in checkpoint {path.name} (more replicas "
            f"than when it was saved): it starts from the global parameters")
    return progress
