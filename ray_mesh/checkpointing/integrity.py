"""What makes a checkpoint directory trustworthy, checked without running anything it holds.

A checkpoint directory sits in storage that other people or jobs may write to (a shared
filesystem, a bucket). Three rules follow:

* **Checks never unpickle.** DCP's ``.metadata`` is a pickle; unpickling a crafted one runs
  code. Completeness is judged from our own JSON files only: the marker (step, progress) and
  a manifest of every file the save wrote, with its size and SHA-256.
* **Only the checkpoint about to be loaded is unpickled**, and first through
  :func:`read_metadata`, an unpickler that admits DCP's metadata classes and nothing else
  (:mod:`ray_mesh.checkpointing.dcp_metadata`: no code runs, no shared object changes, no
  file over a size cap is read), so a crafted ``.metadata`` is refused, and DCP is handed that
  one checked object (it never reads the file itself: :mod:`ray_mesh.checkpointing.safe_load`).
* **Deletion only of what ray_mesh created.** :data:`OWNED` is written into a checkpoint
  directory right after it is made, before any shard; only a directory carrying it may be
  removed by ray_mesh.
* **Nothing for the world.** A checkpoint directory and the files in it lose their "other"
  permission bits (a shared machine's other users cannot read the weights); JSON files are
  written through a fresh ``O_EXCL`` temporary name in the target directory, so a symlink
  planted at a predictable name is never followed.

The manifest detects torn and corrupted saves. It is **no defence against someone who can
write the storage**: they can recompute it. What defends against them is that loading runs
nothing from the files (restricted metadata, plain-data bytes entries, ``weights_only``
tensors) and, above all, storage only the run's own nodes can write (see the docs' trust
model).

This module is Ray-free and torch-light (torch is imported for the metadata classes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

from ray_mesh.checkpointing.dcp_metadata import (
    METADATA,
    metadata_size_problem,
    read_metadata,
)
from ray_mesh.checkpointing.dcp_metadata import METADATA_MAX_BYTES as METADATA_MAX_BYTES
from ray_mesh.core.files import write_atomic
from ray_mesh.core.safe import safe_text

logger = logging.getLogger(__name__)

MARKER = "ray_mesh_checkpoint.json"
"""Written by rank 0 after every rank finished writing; its presence means "complete"."""
MANIFEST = "ray_mesh_manifest.json"
"""Every file the save wrote (relative name -> size and SHA-256), written before the marker."""
OWNED = ".ray_mesh_owned"
"""Written when ray_mesh creates a checkpoint directory: ray_mesh may delete only these."""
_CHUNK = 1 << 20


# ----------------------------------------------------------------------------- ownership
def mark_owned(path: Path) -> None:
    """Claim a directory ray_mesh just created (before any shard is written into it)."""
    write_atomic(path / OWNED, json.dumps({"ray_mesh": "checkpoint directory"}) + "\n")


def is_owned(path: Path) -> bool:
    return (Path(path) / OWNED).is_file()


def claim_dir(path: Path) -> str | None:
    """Make ``path`` an empty directory ray_mesh owns; a refusal message when it is not ours.

    A non-empty directory carrying :data:`OWNED` is an unfinished save of ours and is
    replaced; anything else (another tool's directory, a file, a symlink) is left alone.
    """
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        return (f"Checkpoint path {path} exists and is not a directory ray_mesh created; it "
                f"is left alone. Remove it yourself, or use another run name or storage_path.")
    if path.is_dir() and any(path.iterdir()):
        if not is_owned(path):
            return (f"Checkpoint directory {path} exists and was not created by ray_mesh (no "
                    f"{OWNED}); it is left alone. Remove it yourself, or use another run name "
                    f"or storage_path.")
        logger.warning("ray_mesh: replacing unfinished checkpoint directory %s", safe_text(path))
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    drop_world_access(path)
    mark_owned(path)
    return None


def drop_world_access(path: Path) -> None:
    """Remove the "other" permission bits of ``path`` (group bits follow the user's umask).

    DCP writes shards with the process umask (world-readable by default): model weights on a
    shared machine are then anyone's. A no-op where the filesystem has no such bits.
    """
    try:
        mode = path.stat(follow_symlinks=False).st_mode
        if not stat.S_ISLNK(mode) and mode & 0o007:
            os.chmod(path, stat.S_IMODE(mode) & ~0o007)
    except (OSError, NotImplementedError) as exc:  # storage without POSIX modes
        logger.debug("ray_mesh: cannot restrict %s: %s", path, exc)


def non_finite_params(model: Any) -> list[str]:
    """Names of this rank's parameters (local shards of DTensors) holding NaN or inf."""
    import torch

    bad = []
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not bool(torch.isfinite(local.detach()).all()):
            bad.append(name)
    return bad


# ----------------------------------------------------------------------------- checksums
def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in 1 MiB chunks (shards may be larger than memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def rank_files(path: Path, rank: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The files rank ``rank`` wrote into ``path``: DCP names its shards ``__<rank>_<n>.distcp``
    (rank in the checkpoint group); ``extra`` adds names such as rank 0's ``.metadata``."""
    pattern = re.compile(rf"^__{rank}_\d+\.distcp$")
    names = sorted(p.name for p in path.iterdir() if pattern.match(p.name))
    return names + [n for n in extra if (path / n).is_file()]


def describe(path: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size": bytes, "sha256": hex}}`` for ``names`` in ``path`` (one rank's part);
    each file loses its world permission bits first (:func:`drop_world_access`)."""
    for n in names:
        drop_world_access(path / n)
    return {n: {"size": (path / n).stat().st_size, "sha256": sha256_file(path / n)}
            for n in names}


def write_json_atomic(path: Path, data: Any) -> None:
    """Whole or absent: :func:`ray_mesh.core.files.write_atomic` of the JSON text."""
    write_atomic(path, json.dumps(data, indent=1))


def _safe_name(name: Any) -> bool:
    return (isinstance(name, str) and bool(name) and name not in (".", "..")
            and "/" not in name and "\\" not in name and "\0" not in name)


def manifest_problem(path: Path, verify: bool) -> str | None:
    """Why the manifest does not vouch for ``path``'s files, or None.

    Sizes are always compared; with ``verify`` every file is hashed too (reads the whole
    checkpoint), which catches corruption that keeps a file's length.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return (f"it has no {MANIFEST} (a save that did not finish, or one written by a "
                f"ray_mesh without checksums)")
    except (OSError, ValueError, RecursionError) as exc:
        return f"its {MANIFEST} is unreadable ({exc})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or METADATA not in files:
        return f"its {MANIFEST} lists no files (it must list at least {METADATA})"
    for name, info in sorted(files.items()):
        if (not _safe_name(name) or not isinstance(info, dict)
                or not isinstance(info.get("size"), int)
                or not isinstance(info.get("sha256"), str)):
            return f"its {MANIFEST} has a malformed entry {name!r}: {info!r}"
        f = path / name
        what = "the metadata" if name == METADATA else "shard"
        if not f.is_file():
            return f"{what} {name} is missing"
        size = f.stat().st_size
        if name == METADATA and (too_big := metadata_size_problem(size)):
            return f"its {too_big}"  # before hashing it, and long before unpickling it
        if size != info["size"]:
            how = "truncated" if size < info["size"] else "longer than written"
            return f"{what} {name} is {how} ({size} of {info['size']} bytes)"
        if verify and sha256_file(f) != info["sha256"]:
            return (f"{what} {name} is corrupt: its SHA-256 differs from the one recorded at "
                    f"save (same length, changed content)")
    return None


# ----------------------------------------------------------------------------- marker
def parse_marker(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The marker's content, or None and why it cannot be used (never raises)."""
    try:
        info = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        return None, f"it has no {MARKER} (a save that did not finish on every rank)"
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"its {MARKER} is unreadable ({exc})"
    if not isinstance(info, dict):
        return None, f"its {MARKER} is not a JSON object (got {type(info).__name__})"
    step = info.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None, f"its {MARKER} has no valid step (need an int >= 0, got {step!r})"
    for key, kind in (("data_position", dict), ("mesh", dict), ("world_size", int),
                      ("data_seed", int)):
        value = info.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return None, f"its {MARKER} has a malformed {key!r}: {value!r}"
    return info, None


# ----------------------------------------------------------------------------- metadata
def checked_metadata(path: Path) -> Any:
    """:func:`read_metadata`, and every file it points into is one the manifest vouches for.

    The one read of ``.metadata`` before a load: the object returned is what DCP is handed
    (:mod:`ray_mesh.checkpointing.safe_load`), so the file is never read a second time.

    Also refused: an entry with ``transform_descriptors`` (ray_mesh never writes one; DCP
    would expand a compressed entry in memory before any check of ours).

    Raises:
        ValueError: why the metadata cannot be loaded (a sentence starting with "its ...").
    """
    try:
        meta = read_metadata(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"its {METADATA} is unusable ({exc})") from exc
    try:
        listed = set(json.loads((path / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"its {MANIFEST} is unreadable ({exc})") from exc
    for index, info in (meta.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if rel is not None and str(rel) not in listed:
            raise ValueError(f"its {METADATA} points into {rel!r}, which the {MANIFEST} does "
                             f"not list")
        if getattr(info, "transform_descriptors", None):  # DCP would decompress it unchecked
            raise ValueError(
                f"its {METADATA} declares key {getattr(index, 'fqn', index)!r} in {rel!r} "
                f"as transformed ({info.transform_descriptors!r}: e.g. zstd-compressed, which "
                f"DCP expands in memory before anything checks it); ray_mesh never writes "
                f"transforms, so the checkpoint was altered: resume from another one, and find "
                f"out who can write to this storage")
    return meta


def metadata_problem(path: Path) -> str | None:
    """Why the (restricted-unpickled) metadata cannot be loaded, or None."""
    try:
        checked_metadata(path)
    except ValueError as exc:
        return str(exc)
    return None
