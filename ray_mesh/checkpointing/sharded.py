"""Ray-free sharded checkpoints: torch.distributed.checkpoint (DCP) plus a completion marker.

One checkpoint is one directory. Every rank writes only its own shards (``__<rank>_*.distcp``),
rank 0 writes DCP's ``.metadata``, and after a barrier rank 0 writes :data:`MARKER`, a small
JSON file with the step, the data position and the mesh the checkpoint was written on. A
directory without the marker, or whose files are shorter than DCP's metadata says, is not a
checkpoint: a run killed while writing leaves exactly such a directory behind.

The state goes through ``get_state_dict``/``set_state_dict``, so FSDP2 and tensor-parallel
DTensors are saved by their global shape and load onto any other mesh (resharding is DCP's
job, not ours). This module imports torch, never Ray: it runs under torchrun as well.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

logger = logging.getLogger(__name__)

MARKER = "ray_mesh_checkpoint.json"
"""Written by rank 0 after every rank finished writing; its presence means "complete"."""
METADATA = ".metadata"
FORMAT_VERSION = 1
DIR_PATTERN = re.compile(r"^checkpoint_(\d+)(?:_[0-9a-z]+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or used; the message names it and the fix."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint holds another model: the message lists the keys that do not match."""


def dir_name(step: int, tag: str = "") -> str:
    """``checkpoint_00000042`` (or ``checkpoint_00000042_<tag>``): sorts by step, and
    :func:`step_of` reads the step back. The tag keeps a step saved again after a restart
    out of the directory of the first save, which Ray may delete when it rotates it out."""
    return f"checkpoint_{step:08d}" + (f"_{tag}" if tag else "")


def step_of(path: str | os.PathLike) -> int | None:
    m = DIR_PATTERN.match(Path(path).name)
    return int(m.group(1)) if m else None


@dataclass
class Progress:
    """Where training stands: the next step to run and the data position to continue from."""

    step: int = 0
    data_position: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    """The checkpoint directory this came from; None for a fresh start."""
    mesh: dict[str, Any] | None = None
    world_size: int | None = None


# ----------------------------------------------------------------------------- groups
def checkpoint_group(timeout_s: float = 600.0) -> dist.ProcessGroup:
    """A gloo group for checkpoint coordination, separate from the training group.

    DCP runs its planning collectives (object gathers) on this group. A separate gloo group
    keeps those off NCCL, and lets an async save run them from its background thread while
    the training thread keeps using the default group. Collective call: every rank must
    call it, in the same order as its other ``new_group`` calls.
    """
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def broadcast_from_rank0(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """rank 0's ``obj`` on every rank: one decision, so no two ranks load different steps."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return box[0]


# ----------------------------------------------------------------------------- state
Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None


def _optims(optimizers: Optimizers) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers or [])


def _state(model: torch.nn.Module, optimizers: Optimizers) -> dict:
    optims = _optims(optimizers)
    if optims:
        model_sd, optim_sd = get_state_dict(model, optims)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model)}


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU, on every rank (for comparisons and export).

    Collective: every rank must call it. (``cpu_offload=True`` would leave the other ranks
    an empty dict.)
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in full.items()}


# ----------------------------------------------------------------------------- save
def prepare_dir(path: str | os.PathLike, group: dist.ProcessGroup | None,
                shared: bool = True) -> Path:
    """An empty directory for a checkpoint (a leftover of a killed attempt is removed).

    ``shared``: the directory is on storage every rank sees, so rank 0 alone clears it;
    otherwise (a per-rank staging directory) every rank clears its own.
    """
    path = Path(path)
    if not shared or _rank(group) == 0:
        if path.exists():
            logger.warning("ray_mesh: replacing existing checkpoint directory %s", path)
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    _barrier(group)
    if not path.is_dir():
        raise CheckpointError(
            f"Checkpoint directory {path} does not exist on rank {dist.get_rank()} after rank 0 "
            f"created it: the storage is not shared between the workers. Use a shared "
            f"filesystem (the same mount on every node) or a cloud URI as storage_path."
        )
    return path


def save(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    *,
    group: dist.ProcessGroup | None = None,
    async_save: bool = False,
) -> Future | None:
    """Write this rank's shards of model and optimizer state into ``path``.

    Returns a Future when ``async_save`` (the state is already copied to CPU memory when this
    returns, so training may go on). The checkpoint is not complete until
    :func:`mark_complete` has run on every rank.
    """
    state = _state(model, optimizers)
    if async_save:
        return dcp.async_save(state, checkpoint_id=str(path), process_group=group)
    dcp.save(state, checkpoint_id=str(path), process_group=group)
    return None


def mark_complete(
    path: str | os.PathLike,
    progress: Progress,
    *,
    group: dist.ProcessGroup | None = None,
    mesh: Mapping[str, Any] | None = None,
) -> None:
    """Barrier, then rank 0 writes the marker: every rank has finished its shards by then.

    A second barrier makes "returned on any rank" mean "complete".
    """
    _barrier(group)
    if _rank(group) == 0:
        info = {
            "format": FORMAT_VERSION,
            "step": progress.step,
            "data_position": progress.data_position,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh": dict(mesh) if mesh else None,
            "torch": torch.__version__,
            "time": time.time(),
        }
        tmp = Path(path) / (MARKER + ".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, Path(path) / MARKER)  # atomic: the marker is whole or absent
    _barrier(group)  # returns everywhere only once the checkpoint is complete


# ----------------------------------------------------------------------------- check
def _read_metadata(path: Path) -> Metadata:
    with open(path / METADATA, "rb") as f:
        return pickle.load(f)


def problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is.

    Complete means: the marker is there and parses, DCP's metadata is there and parses, and
    every shard file the metadata points into exists and is long enough.
    """
    path = Path(path)
    if not path.is_dir():
        return "it is not a directory"
    if not (path / MARKER).is_file():
        return f"it has no {MARKER} (a save that did not finish on every rank)"
    try:
        json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as exc:
        return f"its {MARKER} is unreadable ({exc})"
    try:
        meta = _read_metadata(path)
    except FileNotFoundError:
        return f"it has no {METADATA} (DCP metadata)"
    except Exception as exc:  # noqa: BLE001 - any unpickling error means "corrupt"
        return f"its {METADATA} is unreadable ({type(exc).__name__}: {exc})"
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        need[rel] = max(need.get(rel, 0), end)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            return f"shard {rel} is missing"
        if f.stat().st_size < size:
            return f"shard {rel} is truncated ({f.stat().st_size} of {size} bytes)"
    return None


def read_progress(path: str | os.PathLike) -> Progress:
    info = json.loads((Path(path) / MARKER).read_text())
    return Progress(step=int(info["step"]), data_position=dict(info.get("data_position") or {}),
                    path=str(path), mesh=info.get("mesh"), world_size=info.get("world_size"))


def check_compatible(path: str | os.PathLike, model: torch.nn.Module) -> None:
    """Raise :class:`CheckpointMismatchError` naming every model key that does not match.

    DCP alone ignores extra keys in the checkpoint and fails on the first missing one with an
    internal message; this compares the whole model (names and global shapes) first.
    """
    meta = _read_metadata(Path(path))
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


# ----------------------------------------------------------------------------- load
def load(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> Progress:
    """Load a complete checkpoint into ``model`` (and optimizers) on the current mesh."""
    path = Path(path)
    why = problem(path)
    if why:
        raise CheckpointError(f"Checkpoint {path} cannot be loaded: {why}.")
    check_compatible(path, model)
    optims = _optims(optimizers)
    state = _state(model, optims)
    if optims and not any(k.startswith("optim.") for k in
                          _read_metadata(path).state_dict_metadata):
        raise CheckpointMismatchError(
            f"Checkpoint {path} holds no optimizer state, but an optimizer was passed. Pass "
            f"optimizers=None to load the model alone."
        )
    dcp.load(state, checkpoint_id=str(path), process_group=group)
    if optims:
        set_state_dict(model, optims, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    return read_progress(path)


def newest_complete(candidates: Iterable[str | os.PathLike]) -> tuple[str | None, list[str]]:
    """The first complete checkpoint of ``candidates`` (newest first) and warnings for the rest.

    Each skipped directory gets a warning that names it and says why, so a corrupt latest
    checkpoint never silently costs more than the steps since the previous one.
    """
    warnings: list[str] = []
    for cand in candidates:
        why = problem(cand)
        if why is None:
            return str(cand), warnings
        warnings.append(f"ray_mesh: skipping checkpoint {cand}: {why}.")
    return None, warnings


def older_siblings(path: str | os.PathLike) -> list[Path]:
    """``checkpoint_<step>`` directories next to ``path`` with a smaller step, newest first."""
    path = Path(path)
    step = step_of(path)
    if step is None or not path.parent.is_dir():
        return []
    found = [(s, p) for p in path.parent.iterdir()
             if (s := step_of(p)) is not None and s < step and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


__all__ = [
    "MARKER",
    "CheckpointError",
    "CheckpointMismatchError",
    "Progress",
    "check_compatible",
    "checkpoint_group",
    "dir_name",
    "full_model_state",
    "load",
    "mark_complete",
    "newest_complete",
    "older_siblings",
    "prepare_dir",
    "problem",
    "read_progress",
    "save",
    "step_of",
]
