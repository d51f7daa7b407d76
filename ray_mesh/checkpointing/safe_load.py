"""DCP loading that runs nothing from the checkpoint's files.

Two holes in ``torch.distributed.checkpoint.load`` (checked on torch 2.13;
upstream: torch-dcp-load-unpickles) let whoever can write the storage run code in every rank
that loads:

* its ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle``, after
  (and independently of) any check of ours, so a file swapped in between our check and its
  read runs;
* its ``DefaultLoadPlanner.load_bytes`` reads every key the metadata declares as bytes
  (``BytesStorageMetadata``) with ``torch.load(..., weights_only=False)``: a shard holding a
  ``__reduce__`` payload runs, even with a perfectly restricted ``.metadata``.

:func:`load_state` closes both with the public extension points DCP offers: a storage reader
that hands DCP the ``Metadata`` our restricted unpickler already produced (one read, nothing
to race), and a load planner that reads bytes entries with ``weights_only=True`` (plain data:
numbers, strings, lists, dicts, tensors) and refuses a bytes entry where the state dict holds
a tensor. Tensor entries DCP already reads with ``weights_only=True``. Every refusal is a
:class:`CheckpointError` naming the checkpoint, the key and the file.

The integrity manifest is no defence here: anyone who can write the files can recompute it.

Before any of that, :func:`check_compatible` compares the whole model (names and global
shapes) with the checkpoint's metadata: DCP alone ignores extra keys and fails on the first
missing one with an internal message.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ray_mesh import private_apis
from ray_mesh.checkpointing.integrity import METADATA, read_metadata
from ray_mesh.errors import CheckpointError, CheckpointMismatchError


class _CheckedMetadataReader(FileSystemReader):
    """A ``FileSystemReader`` whose metadata is the object we already read and checked."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never asks for rank files
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _PlainDataPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles bytes entries as plain data only."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._path = path

    def _file_of(self, index: Any) -> str:
        info = (self.metadata.storage_data or {}).get(index) if self.metadata else None
        return str(getattr(info, "relative_path", "?"))

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        declared = metadata.state_dict_metadata if metadata is not None else {}
        for fqn, value in self.state_dict.items():
            if isinstance(declared.get(fqn), BytesStorageMetadata) and isinstance(
                    value, torch.Tensor):
                files = sorted({self._file_of(i) for i in (metadata.storage_data or {})
                                if getattr(i, "fqn", None) == fqn})
                raise CheckpointError(
                    f"Checkpoint {self._path} cannot be loaded: its {METADATA} declares key "
                    f"{fqn!r} as pickled bytes (in {', '.join(files) or 'no file'}) where the "
                    f"model or optimizer holds a tensor. ray_mesh never writes that: the "
                    f"checkpoint was altered. Resume from another checkpoint, and find out "
                    f"who can write to this storage.")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any refusal of torch's restricted loader
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise CheckpointError(
                f"Checkpoint {self._path} cannot be loaded: key {fqn!r} in file "
                f"{self._file_of(read_item.storage_index)} is a pickled object that is not "
                f"plain data ({type(exc).__name__}: {first}); loading it could run code, so "
                f"it was refused unread. ray_mesh never writes such an entry: the checkpoint "
                f"was altered. Resume from another checkpoint, and find out who can write to "
                f"this storage.") from None
        if self.flatten_state_dict:
            private_apis.dcp_set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _our_error(exc: CheckpointException) -> CheckpointError | None:
    """Our refusal from inside DCP's wrapper (it gathers every rank's failure)."""
    for failure in exc.failures.values():
        err = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(err, CheckpointError):
            return err
    return None


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP in one process without a process group, on purpose (a group of one worker
    outside Ray Train, a restore on the driver): without this, DCP warns on every save and
    load that it is "assuming the intent is to save/load in a single process". Only that
    warning is silenced, only while no process group exists
    (upstream: torch-dcp-single-process-warning)."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, "
                                "unavailable or uninitialized", category=UserWarning)
        yield


def load_state(path: str | os.PathLike, state: dict[str, Any], metadata: Metadata,
               group: dist.ProcessGroup | None = None, *, verified: bool = False) -> None:
    """``dcp.load(state)`` from ``path`` with ``metadata`` (from
    :func:`ray_mesh.checkpointing.integrity.read_metadata`): nothing in the files runs.

    ``verified``: every file was just hashed against the manifest (``load(verify=True)``),
    so a shard DCP cannot read was written that way, not damaged since: the error says so
    instead of advising a verification that already ran.

    Raises:
        CheckpointError: a bytes entry that is not plain data or stands where a tensor
            belongs (naming the key and the file), or shards DCP cannot read.
    """
    path = Path(path)
    try:
        with single_process_ok():
            dcp.load(state, storage_reader=_CheckedMetadataReader(path, metadata),
                     planner=_PlainDataPlanner(path), process_group=group)
    except CheckpointException as exc:  # a BaseException subclass: caught by name only
        ours = _our_error(exc)
        if ours is not None:
            raise CheckpointError(str(ours)) from None
        why = (
            "Every file matches the SHA-256 recorded at save, so the shards were unreadable "
            "when written (or were altered together with the manifest, by someone who can "
            "write this storage); resume from an older checkpoint." if verified else
            "A shard is corrupt although its size is right; load again with verify=True "
            "(hashes every file against the manifest) to name it, or resume from an older "
            "checkpoint.")
        raise CheckpointError(
            f"Checkpoint {path} cannot be loaded: DCP could not read its shards "
            f"({str(exc).splitlines()[0][:300]}). {why}") from exc


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
            meta = read_metadata(Path(path))
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
