"""Sharded checkpoints: DCP on the mesh (Ray-free) and their life in Ray Train.

``sharded`` is Ray-free (torchrun works); ``Checkpointer`` and ``check_storage`` import Ray.
Every name loads on first use, so ``import ray_mesh.checkpointing`` stays Ray-free, and a
driver that only needs a submodule without torch (``names``: the run's folder names) does
not pay for DCP's import (~0.7 s of CPU).
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers, editors and the API reference see
    from ray_mesh.checkpointing.sharded import (
        MARKER,
        CheckpointError,
        CheckpointMismatchError,
        NonFiniteError,
        Progress,
        full_model_state,
        load,
        problem,
        save,
    )
    from ray_mesh.checkpointing.storage import StorageError, check_storage
    from ray_mesh.checkpointing.train import Checkpointer

__all__ = [
    "MARKER",
    "CheckpointError",
    "CheckpointMismatchError",
    "Checkpointer",
    "NonFiniteError",
    "Progress",
    "StorageError",
    "check_storage",
    "full_model_state",
    "load",
    "problem",
    "save",
]


_SHARDED = ("MARKER", "CheckpointError", "CheckpointMismatchError", "NonFiniteError", "Progress",
            "full_model_state", "load", "problem", "save")


def __getattr__(name: str):
    if name in _SHARDED:
        from ray_mesh.checkpointing import sharded

        return getattr(sharded, name)
    if name == "Checkpointer":
        from ray_mesh.checkpointing.train import Checkpointer

        return Checkpointer
    if name in ("check_storage", "StorageError"):
        from ray_mesh.checkpointing import storage

        return getattr(storage, name)
    raise AttributeError(f"module 'ray_mesh.checkpointing' has no attribute {name!r}")
