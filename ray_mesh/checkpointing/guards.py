"""Checks of a :class:`~ray_mesh.checkpointing.train.Checkpointer`'s arguments and context.

A wrong argument (``every='2'``) or a Checkpointer built outside a Ray Train training function
fails at construction with what to change, not at the first save with a ``TypeError`` from
deep inside.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from ray_mesh.checkpointing.sharded import CheckpointError
from ray_mesh.core import runtime


def check_args(model: Any, optimizers: Any, *, every: Any, async_save: Any, upload: Any,
               timeout_s: Any, wait_committed: Any, check_finite: Any, data_seed: Any,
               resume_from: Any) -> None:
    """Every bad argument fails at construction, naming the argument and what it takes."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Checkpointer(model=...) takes a torch.nn.Module, got "
                        f"{type(model).__name__}.")
    optims = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
    try:
        bad = [type(o).__name__ for o in (optims or [])
               if not isinstance(o, torch.optim.Optimizer)]
    except TypeError:
        bad = [type(optimizers).__name__]
    if bad:
        raise TypeError(f"Checkpointer(optimizers=...) takes a torch.optim.Optimizer, a list "
                        f"of them or None; got {', '.join(bad)}.")
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"Checkpointer(every=...) must be an int >= 0 (save every N steps; 0 "
                         f"saves only on report(save=True)), got {every!r}.")
    for name, value in (("async_save", async_save), ("wait_committed", wait_committed),
                        ("check_finite", check_finite)):
        if not isinstance(value, bool):
            raise TypeError(f"Checkpointer({name}=...) must be True or False, got {value!r}.")
    if upload is not None and not isinstance(upload, bool):
        raise TypeError(f"Checkpointer(upload=...) must be None (decide from the storage), "
                        f"True or False, got {upload!r}.")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
            or not timeout_s > 0):
        raise ValueError(f"Checkpointer(timeout_s=...) must be a number of seconds > 0, got "
                         f"{timeout_s!r}.")
    if data_seed is not None and (isinstance(data_seed, bool) or not isinstance(data_seed, int)):
        raise TypeError(f"Checkpointer(data_seed=...) must be an int or None, got "
                        f"{data_seed!r}.")
    if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
        raise TypeError(f"Checkpointer(resume_from=...) must be a checkpoint directory path, "
                        f"got {resume_from!r}.")


def train_context() -> Any:
    """Ray Train's context, or a clear error when not inside a Ray Train training function."""
    ctx = runtime.train_context()
    if ctx is None:
        raise CheckpointError(
            "Checkpointer works inside a Ray Train train function only (the function given "
            "to TorchTrainer, started by trainer.fit()): it reports checkpoints to Ray Train. "
            "Create it in the train loop; outside Ray (torchrun, a notebook) use "
            "ray_mesh.checkpointing.save(...) and load(...) on a directory instead.")
    if not torch.distributed.is_initialized():
        raise CheckpointError(
            "Checkpointer needs torch.distributed initialised in the workers: run the train "
            "function with TorchTrainer and torch_config=ray_mesh.MeshConfig(...)."
        )
    from ray_mesh.checkpointing.storage import check_run_name

    check_run_name(ctx.get_experiment_name())
    return ctx


def check_report(step: Any, data_position: Any) -> None:
    """``report``'s step and data position, checked on every rank before any collective (a
    position that cannot be written as JSON would otherwise fail on rank 0 alone, mid-save)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"Checkpointer.report(step=...) must be an int >= 0 (steps done so "
                        f"far), got {step!r}.")
    if data_position is None:
        return
    if not isinstance(data_position, Mapping):
        raise TypeError(f"Checkpointer.report(data_position=...) must be a dict (e.g. "
                        f"{{'epoch': 1, 'offset': 640}}), got {type(data_position).__name__}.")
    try:
        json.dumps(dict(data_position))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Checkpointer.report(data_position=...) must hold JSON values only "
                        f"(ints, floats, strings, lists, dicts): {exc}.") from exc
