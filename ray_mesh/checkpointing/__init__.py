"""Sharded checkpoints: DCP on the mesh (Ray-free) and their life in Ray Train.

``sharded`` is Ray-free (torchrun works); ``Checkpointer`` and ``check_storage`` import Ray
lazily, so ``import ray_mesh.checkpointing`` stays Ray-free.
"""

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


def __getattr__(name: str):
    if name == "Checkpointer":
        from ray_mesh.checkpointing.train import Checkpointer

        return Checkpointer
    if name in ("check_storage", "StorageError"):
        from ray_mesh.checkpointing import storage

        return getattr(storage, name)
    raise AttributeError(f"module 'ray_mesh.checkpointing' has no attribute {name!r}")
