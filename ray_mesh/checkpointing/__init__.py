"""Sharded checkpoints: DCP on the mesh (Ray-free) and their life in Ray Train.

In a Ray Train run, :class:`Checkpointer` saves every ``every`` steps, reports the checkpoint
to Ray and restores the newest complete one; :func:`check_storage` checks the storage path
first (a directory every node sees, or an object-storage URI). Ray-free (torchrun too):
:func:`save`, :func:`load`, :func:`problem`, :func:`full_model_state`, and
:mod:`ray_mesh.checkpointing.remote` for a checkpoint in object storage.

``Checkpointer`` and ``check_storage`` import Ray. Every name loads on first use, so
``import ray_mesh.checkpointing`` stays Ray-free, and a driver that only needs a submodule
without torch (``names``: the run's folder names) does not pay for DCP's import (~0.7 s of
CPU).

Stability: stable
"""

import importlib
from typing import TYPE_CHECKING

from ray_mesh.core import deprecation as _deprecation

if TYPE_CHECKING:  # what type checkers, editors and the API reference see
    from ray_mesh.checkpointing import remote
    from ray_mesh.checkpointing.sharded import (
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
    "remote",
    "save",
]

# name -> (module, attribute; "" for the module itself), imported on first use (PEP 562)
_LAZY: dict[str, tuple[str, str]] = {
    **{name: ("ray_mesh.checkpointing.sharded", name) for name in (
        "CheckpointError", "CheckpointMismatchError", "NonFiniteError", "Progress",
        "full_model_state", "load", "problem", "save")},
    "Checkpointer": ("ray_mesh.checkpointing.train", "Checkpointer"),
    "StorageError": ("ray_mesh.checkpointing.storage", "StorageError"),
    "check_storage": ("ray_mesh.checkpointing.storage", "check_storage"),
    "remote": ("ray_mesh.checkpointing.remote", ""),
}

DEPRECATED: dict[str, _deprecation.Deprecated] = {
    "MARKER": _deprecation.Deprecated(
        "ray_mesh.checkpointing.integrity:MARKER",
        "the marker file's name is internal; import it from ray_mesh.checkpointing.integrity "
        "(it leaves ray_mesh.checkpointing in 0.2.0)"),
}
"""Deprecated public names of this package (``ray_mesh.core.deprecation``)."""


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        return _deprecation.resolve(__name__, name, DEPRECATED)
    module = importlib.import_module(where[0])
    return getattr(module, where[1]) if where[1] else module
