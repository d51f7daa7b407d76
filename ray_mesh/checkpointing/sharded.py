"""Ray-free sharded checkpoints: torch.distributed.checkpoint (DCP) plus a completion marker.

One checkpoint is one directory. ray_mesh claims it (:data:`~integrity.OWNED`) before anything
is written, every rank writes only its own shards (``__<rank>_*.distcp``) and its random state,
rank 0 writes DCP's ``.metadata``; then every rank hashes its files, rank 0 gathers those into
:data:`~integrity.MANIFEST` and finally writes :data:`MARKER`, a small JSON file with the step,
the data position and the mesh the checkpoint was written on. A directory without the marker,
or whose files differ from the manifest, is not a checkpoint: a run killed while writing
leaves exactly such a directory behind. Checks read only those JSON files (never the pickled
``.metadata``: see :mod:`ray_mesh.checkpointing.integrity`).

The state goes through ``get_state_dict``/``set_state_dict``, so FSDP2 and tensor-parallel
DTensors are saved by their global shape and load onto any other mesh (resharding is DCP's
job, not ours). This module imports torch, never Ray: it runs under torchrun as well.
"""

from __future__ import annotations

import logging
import os
import re
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import ray_mesh.checkpointing.integrity as integrity
import ray_mesh.checkpointing.rng as rng
from ray_mesh.checkpointing.integrity import MANIFEST, MARKER, METADATA
from ray_mesh.checkpointing.integrity import OWNED as OWNED
from ray_mesh.checkpointing.safe_load import check_compatible, load_state
from ray_mesh.errors import CheckpointError, CheckpointMismatchError, NonFiniteError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
DIR_PATTERN = re.compile(r"^checkpoint_(\d+)(?:_[0-9a-z]+)?$")


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
    """Where training stands: the next step to run and the data position to continue from.

    Stability: stable
    """

    step: int = 0
    data_position: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    """The checkpoint directory this came from; None for a fresh start."""
    mesh: dict[str, Any] | None = None
    world_size: int | None = None
    data_seed: int | None = None
    """A data-order seed saved with the checkpoint (e.g. a sampler's), handed back on resume."""
    warnings: list[str] = field(default_factory=list)
    """What a load could not restore exactly (e.g. random state from another world size)."""


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

    Stability: stable
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in full.items()}


# ----------------------------------------------------------------------------- save
def prepare_dir(path: str | os.PathLike, group: dist.ProcessGroup | None,
                shared: bool = True) -> Path:
    """An empty directory for a checkpoint, claimed as ray_mesh's (:data:`OWNED`).

    A leftover of a killed attempt (a directory ray_mesh created: it carries :data:`OWNED`)
    is removed; any other non-empty directory is left alone and refused. ``shared``: the
    directory is on storage every rank sees, so rank 0 alone prepares it; otherwise (a
    per-rank staging directory) every rank prepares its own.
    """
    path = Path(path)
    refusal = None
    if not shared or _rank(group) == 0:
        refusal = integrity.claim_dir(path)
    if shared:
        refusal = broadcast_from_rank0(refusal, group)
    elif dist.is_initialized():  # every rank decides for itself: all raise if one refuses
        found: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, refusal, group=group)
        refusal = next((r for r in found if r), None)
    if refusal:
        raise CheckpointError(refusal)
    _barrier(group)
    if not path.is_dir():
        raise CheckpointError(
            f"Checkpoint directory {path} does not exist on rank {dist.get_rank()} after rank 0 "
            f"created it: the storage is not shared between the workers. Use a shared "
            f"filesystem (the same mount on every node) or a cloud URI as storage_path."
        )
    return path


def _check_finite(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`NonFiniteError` on every rank when any rank's parameters hold NaN/inf.

    Collective (one tiny all-reduce), so that no rank goes on into the save's collectives
    while another raises.
    """
    bad = integrity.non_finite_params(model)
    flag = torch.tensor([len(bad)], dtype=torch.int64)
    if dist.is_initialized():
        if dist.get_backend(group) == "nccl":  # group=None on a GPU run: the NCCL default
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()):
        where = f"parameters {', '.join(bad[:8])} on this rank" if bad else "another rank"
        raise NonFiniteError(
            f"Refusing to save a checkpoint: the model holds NaN or inf ({where}). Saving it "
            f"would rotate good checkpoints out for a broken one. Find the divergence (lower "
            f"the learning rate, clip gradients, check the data), then resume from the last "
            f"good checkpoint; pass check_finite=False to save non-finite weights anyway."
        )


def save(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    *,
    group: dist.ProcessGroup | None = None,
    async_save: bool = False,
    check_finite: bool = True,
    save_rng: bool = True,
) -> Future | None:
    """Write this rank's shards of model and optimizer state (and random state) into ``path``.

    Returns a Future when ``async_save`` (the state is already copied to CPU memory when this
    returns, so training may go on). The checkpoint is not complete until
    :func:`mark_complete` has run on every rank. ``check_finite``: refuse (every rank raises
    :class:`NonFiniteError`) when any parameter is NaN/inf. ``save_rng``: this rank's random
    state goes along (see :mod:`ray_mesh.checkpointing.rng`), captured now.

    Stability: stable
    """
    if check_finite:
        _check_finite(model, group)
    if save_rng:
        rng.save(Path(path), _rank(group))
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
    """Every rank hashes the files it wrote; rank 0 gathers them into the manifest, then
    writes the marker (each file whole or absent: written and renamed).

    The gather doubles as the barrier "every rank has finished its shards"; a final barrier
    makes "returned on any rank" mean "complete".
    """
    path = Path(path)
    rank = _rank(group)
    mine = integrity.describe(path, integrity.rank_files(
        path, rank, (rng.file_name(rank),) + ((METADATA,) if rank == 0 else ())))
    parts: list[Any] = [mine]
    if dist.is_initialized():
        parts = [None] * dist.get_world_size(group) if rank == 0 else []
        dist.gather_object(mine, parts if rank == 0 else None,
                           dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    if rank == 0:
        files = {name: info for part in parts for name, info in (part or {}).items()}
        integrity.write_json_atomic(path / MANIFEST, {"format": FORMAT_VERSION, "files": files})
        info = {
            "format": FORMAT_VERSION,
            "step": progress.step,
            "data_position": progress.data_position,
            "data_seed": progress.data_seed,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "mesh": dict(mesh) if mesh else None,
            "torch": torch.__version__,
            "time": time.time(),
        }
        integrity.write_json_atomic(path / MARKER, info)
    _barrier(group)  # returns everywhere only once the checkpoint is complete


# ----------------------------------------------------------------------------- check
def problem(path: str | os.PathLike, verify: bool = False) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None when it is. Never unpickles.

    Complete means: the marker is there and valid, the manifest is there, and every file it
    lists (shards, ``.metadata``, random state) exists with the size recorded at save; with
    ``verify`` also with the SHA-256 recorded at save (reads every byte).

    Stability: stable
    """
    path = Path(path)
    if not path.is_dir():
        return "it is not a directory"
    _, why = integrity.parse_marker(path)
    return why or integrity.manifest_problem(path, verify)


def read_progress(path: str | os.PathLike) -> Progress:
    info, why = integrity.parse_marker(Path(path))
    if info is None:
        raise CheckpointError(f"Checkpoint {path} cannot be used: {why}.")
    return Progress(step=info["step"], data_position=dict(info.get("data_position") or {}),
                    path=str(path), mesh=info.get("mesh"), world_size=info.get("world_size"),
                    data_seed=info.get("data_seed"))


# ----------------------------------------------------------------------------- load
def checked_for_load(path: Path, verify: bool) -> Any:
    """The checkpoint's DCP ``Metadata``, read once through the restricted unpickler after
    :func:`problem` found nothing; a :class:`CheckpointError` saying why otherwise."""
    why = problem(path, verify)
    if why is None:
        try:
            return integrity.checked_metadata(path)
        except (OSError, ValueError) as exc:
            why = str(exc)
    raise CheckpointError(f"Checkpoint {path} cannot be loaded: {why}.")


def loadable_problem(path: str | os.PathLike, verify: bool = True) -> str | None:
    """:func:`problem`, then (only when that finds nothing) the metadata through the restricted
    unpickler: for the one checkpoint about to be loaded, never for a mere scan."""
    return problem(path, verify) or integrity.metadata_problem(Path(path))


def load(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizers: Optimizers = None,
    *,
    group: dist.ProcessGroup | None = None,
    verify: bool = True,
    restore_rng: bool = True,
) -> Progress:
    """Load a complete checkpoint into ``model`` (and optimizers) on the current mesh.

    ``verify``: hash every file against the manifest first (reads the whole checkpoint once
    per rank; pass False when one rank already verified it). ``restore_rng``: set this
    rank's random state from the checkpoint; what could not be restored is listed in
    ``Progress.warnings``.

    Stability: stable
    """
    path = Path(path)
    meta = checked_for_load(path, verify)
    check_compatible(path, model, meta)
    optims = _optims(optimizers)
    state = _state(model, optims)
    if optims and not any(k.startswith("optim.") for k in meta.state_dict_metadata):
        raise CheckpointMismatchError(
            f"Checkpoint {path} holds no optimizer state, but an optimizer was passed. Pass "
            f"optimizers=None to load the model alone."
        )
    load_state(path, state, meta, group, verified=verify)
    if optims:
        set_state_dict(model, optims, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    progress = read_progress(path)
    if restore_rng:
        progress.warnings += rng.load(path, _rank(group))
    return progress


def newest_complete(candidates: Iterable[str | os.PathLike],
                    verify: bool = True) -> tuple[str | None, list[str]]:
    """The first loadable checkpoint of ``candidates`` (newest first) and warnings for the rest.

    Each skipped directory gets a warning that names it and says why, so a corrupt latest
    checkpoint never silently costs more than the steps since the previous one. Only the
    candidate returned is unpickled (restricted; see :func:`loadable_problem`).
    """
    warnings: list[str] = []
    for cand in candidates:
        why = loadable_problem(cand, verify)
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


__all__ = ["Progress", "full_model_state", "load", "problem", "save"]
