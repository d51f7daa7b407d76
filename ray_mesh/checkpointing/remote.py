"""Checkpoints in a bucket, outside Ray Train: download one, check it, load it.

Inside a Ray Train function the :class:`~ray_mesh.checkpointing.train.Checkpointer` reads
checkpoints through Ray's ``Checkpoint`` API. Elsewhere (a torchrun job, an export script,
an evaluation) a checkpoint a run left in object storage is loaded with :func:`load`:
the directory is copied through ``pyarrow.fs`` into a private temporary directory, and
every file that came back is hashed against the manifest before anything is unpickled
(:mod:`ray_mesh.checkpointing.integrity`), so a tampered or truncated object in the bucket
is refused with a :class:`~ray_mesh.errors.CheckpointError` naming it. DCP itself reads
local files only; the copy is removed when the load is done. Ray-free.

Stability: experimental
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

import ray_mesh.checkpointing.sharded as sharded
from ray_mesh.core import object_store
from ray_mesh.errors import CheckpointError


def download(path: str, dest: str | os.PathLike, *, endpoint: str | None = None) -> Path:
    """Copy checkpoint directory ``path`` (a URI, or a local path) into ``dest``; returns it.

    ``endpoint``: the S3-compatible server of an ``s3://`` path (as the job's
    ``run.storage_endpoint``). Raises :class:`CheckpointError` when there is nothing there,
    or when an object vanishes during the copy (named, never a bare ``FileNotFoundError``).

    Stability: experimental
    """
    import pyarrow.fs

    fs, root = object_store.filesystem(path, endpoint)
    try:
        kind = fs.get_file_info(root).type
    except OSError as exc:
        raise CheckpointError(f"Checkpoint {path} cannot be read: {exc}. Check the URI, "
                              f"the endpoint and the storage credentials.") from None
    if kind != pyarrow.fs.FileType.Directory:
        raise CheckpointError(f"Checkpoint {path} does not exist (nothing at {root}): check "
                              f"the path (a checkpoint_<step> directory of the run).")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        pyarrow.fs.copy_files(root, str(dest), source_filesystem=fs,
                              destination_filesystem=pyarrow.fs.LocalFileSystem())
    except FileNotFoundError as exc:  # listed, then gone: rotated out or replaced mid-copy
        raise CheckpointError(
            f"Checkpoint {path} changed while it was being copied: {_missing(exc)} was listed "
            f"but is gone (a run rotating checkpoints out, num_to_keep, deletes old ones). "
            f"Load a checkpoint the run still keeps (a newer checkpoint_<step>), or stop the "
            f"run that prunes this one, then retry.") from None
    except OSError as exc:
        raise CheckpointError(f"Checkpoint {path} cannot be copied: {exc}. Check the storage "
                              f"credentials and this machine's free space ({dest}), then "
                              f"retry.") from None
    return dest


def _missing(exc: OSError) -> str:
    """The object a pyarrow ``FileNotFoundError`` names (in quotes in its message), else the
    message itself: pyarrow sets no ``filename``."""
    if exc.filename:
        return str(exc.filename)
    quoted = re.search(r"'([^']+)'", str(exc))
    return quoted.group(1) if quoted else str(exc)


def load(path: str, model: torch.nn.Module, optimizers: sharded.Optimizers = None, *,
         endpoint: str | None = None, group: torch.distributed.ProcessGroup | None = None,
         restore_rng: bool = True) -> sharded.Progress:
    """:func:`ray_mesh.checkpointing.sharded.load` of a checkpoint in object storage.

    The copy on this machine is verified against the checkpoint's manifest (every byte
    hashed) before it is loaded; a local ``path`` is loaded in place, verified likewise.

    Stability: experimental
    """
    if not object_store.is_uri(path):
        return sharded.load(path, model, optimizers, group=group, verify=True,
                            restore_rng=restore_rng)
    tmp = tempfile.mkdtemp(prefix="ray_mesh_download_")  # 0700, private to this user
    try:
        local = download(path, Path(tmp) / Path(path.split("?", 1)[0]).name,
                         endpoint=endpoint)
        try:
            progress = sharded.load(local, model, optimizers, group=group, verify=True,
                                    restore_rng=restore_rng)
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace(str(local), path)) from None
        progress.path = path
        return progress
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["download", "load"]
