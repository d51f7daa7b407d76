"""Checkpoint errors, and whether a checkpoint holds the model it is about to be loaded into.

DCP alone ignores extra keys in a checkpoint and fails on the first missing one with an internal
message; :func:`check_compatible` compares the whole model (names and global shapes) first,
from the metadata read through the restricted unpickler of
:mod:`ray_mesh.checkpointing.integrity`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import ray_mesh.checkpointing.integrity as integrity
from ray_mesh.errors import CheckpointError, CheckpointMismatchError, NonFiniteError


def check_compatible(path: str | os.PathLike, model: torch.nn.Module,
                     metadata: Any = None) -> None:
    """Raise :class:`CheckpointMismatchError` naming every model key that does not match.

    DCP alone ignores extra keys in the checkpoint and fails on the first missing one with an
    internal message; this compares the whole model (names and global shapes) first.
    ``metadata``: the checkpoint's DCP ``Metadata`` when already read (restricted); else it
    is read here.
    """
    meta = metadata
    if meta is None:
        try:
            meta = integrity.read_metadata(Path(path))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"Checkpoint {path} cannot be used: {exc}. Resume from "
                                  f"another checkpoint.") from exc
    saved = {k[len("model."):]: v for k, v in meta.state_dict_metadata.items()
             if k.startswith("model.")}
    mine = get_model_state_dict(model)
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    shapes = []
    for key in sorted(set(mine) & set(saved)):
        value, info = mine[key], saved[key]
        # DTensor.shape is the global shape, as stored in the metadata.
        if (isinstance(value, torch.Tensor) and isinstance(info, TensorStorageMetadata)
                and tuple(value.shape) != tuple(info.size)):
            shapes.append(f"{key}: checkpoint {tuple(info.size)}, model {tuple(value.shape)}")
    if missing or unexpected or shapes:
        parts = []
        for what, items in (("missing from the checkpoint", missing),
                            ("in the checkpoint but not in the model", unexpected),
                            ("with another shape", shapes)):
            if items:
                shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)"
                                                if len(items) > 8 else "")
                parts.append(f"{what}: {shown}")
        raise CheckpointMismatchError(
            f"Checkpoint {path} was written by a different model. Keys " + "; keys ".join(parts)
            + ". Resume it with the model that wrote it, or start this model in a new run "
            "(another RunConfig(name=...) or storage_path) instead of resuming."
        )


__all__ = ["CheckpointError", "CheckpointMismatchError", "NonFiniteError", "check_compatible"]
