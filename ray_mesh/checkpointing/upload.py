"""A finished local checkpoint directory copied into the run's storage, its marker last.

Why: a home lab's tailnet has no directory every node reaches, so a checkpoint that must
outlive the node that wrote it (the replica groups' fallback, :mod:`ray_mesh.replicas.fallback`)
goes to the run's storage: a bucket, or a shared directory. It is written locally first,
which is fast and all its writers wait for, and copied from there in the background.

The copy writes :data:`~integrity.OWNED` first (the directory is ray_mesh's from then on),
then the shards and the manifest, checks that every object has the size written, and
writes :data:`~integrity.MARKER` last: a copy cut short (a node gone, the server down, the
deadline) leaves a directory without a marker, which no reader takes for a checkpoint.
Every request is bounded (pyarrow's S3 timeouts), and the copy as a whole by a deadline.
Only directories that carry ``OWNED`` are ever deleted (rotation, a failed copy's rest).
Ray-free.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ray_mesh.checkpointing.integrity import MANIFEST, MARKER, OWNED, drop_world_access
from ray_mesh.checkpointing.sharded import DIR_PATTERN
from ray_mesh.core import object_store
from ray_mesh.errors import CheckpointError

CHUNK = 8 << 20  # bytes per write: each is one bounded request's worth
REQUEST_TIMEOUT_S = 30.0  # pyarrow's connect and request timeouts for each S3 call
RETRIES = 3


def join(location: str, *parts: str) -> str:
    """``location/part/...``, put before a URI's query (pyarrow's ``?endpoint_override=``
    form keeps its options at the end)."""
    head, sep, query = location.partition("?")
    return "/".join([head.rstrip("/"), *parts]) + sep + query


def _fs(location: str, endpoint: str | None, timeout_s: float) -> tuple[Any, str]:
    return object_store.filesystem(location, endpoint, timeout_s=timeout_s, retries=RETRIES)


def upload_dir(local: str | Path, dest: str, endpoint: str | None = None, *,
               deadline_s: float = 600.0, request_timeout_s: float = REQUEST_TIMEOUT_S) -> int:
    """Copy the finished checkpoint directory ``local`` to ``dest`` (a URI or a path; an
    ``s3://`` one at ``endpoint``), marker last; returns the bytes copied.

    Raises:
        CheckpointError: ``local`` has no marker (not finished), an object came out of
            another size, or the copy did not end within ``deadline_s``.
        OSError: the storage refused a request (pyarrow's error, which names it).
    """
    local = Path(local)
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    if MARKER not in names or OWNED not in names:
        raise CheckpointError(f"{local} is not a finished checkpoint (no {MARKER} or "
                              f"{OWNED}): nothing was copied to {object_store.redacted(dest)}")
    fs, root = _fs(dest, endpoint, request_timeout_s)
    local_fs = type(fs).__name__ == "LocalFileSystem"
    order = [OWNED] + [n for n in names if n not in (OWNED, MANIFEST, MARKER)] + [MANIFEST]
    deadline = time.monotonic() + deadline_s
    fs.create_dir(root, recursive=True)
    if local_fs:
        drop_world_access(Path(root))
    total = 0
    for name in order + [MARKER]:
        if name == MARKER:  # every other object whole before the marker says "complete"
            _check_sizes(fs, root, local, order, dest)
        with open(local / name, "rb") as src, fs.open_output_stream(f"{root}/{name}") as dst:
            while chunk := src.read(CHUNK):
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"copying {local.name} to {object_store.redacted(dest)} did not finish "
                        f"within {deadline_s:g} s ({total} bytes copied): the storage is too "
                        f"slow or unreachable; check the link to it, or raise the upload bound")
                dst.write(chunk)
                total += len(chunk)
        if local_fs:
            drop_world_access(Path(root) / name)
    return total


def _check_sizes(fs: Any, root: str, local: Path, names: list[str], dest: str) -> None:
    infos = fs.get_file_info([f"{root}/{n}" for n in names])
    for name, info in zip(names, infos, strict=True):
        want = (local / name).stat().st_size
        if info.size != want:
            raise CheckpointError(
                f"{object_store.redacted(dest)}/{name} holds {info.size} bytes after the "
                f"copy, {want} were written: the storage did not keep the object whole")


def remove(dest: str, endpoint: str | None = None, *,
           request_timeout_s: float = REQUEST_TIMEOUT_S) -> bool:
    """Delete checkpoint directory ``dest`` if ray_mesh created it (it holds ``OWNED``);
    whether it did. Anything else is left alone."""
    import pyarrow.fs

    fs, root = _fs(dest, endpoint, request_timeout_s)
    if fs.get_file_info(f"{root}/{OWNED}").type != pyarrow.fs.FileType.File:
        return False
    fs.delete_dir(root)
    return True


def complete(location: str, endpoint: str | None = None, *,
             request_timeout_s: float = REQUEST_TIMEOUT_S) -> list[tuple[int, str]]:
    """``(step, uri)`` of each complete checkpoint directory (``checkpoint_<step>_<tag>``
    holding its marker and ``OWNED``) directly under ``location``, newest first."""
    import pyarrow.fs

    fs, root = _fs(location, endpoint, request_timeout_s)
    entries = fs.get_file_info(pyarrow.fs.FileSelector(root, allow_not_found=True))
    found = []
    for entry in entries:
        m = DIR_PATTERN.match(entry.base_name)
        if entry.type != pyarrow.fs.FileType.Directory or not m:
            continue
        marks = fs.get_file_info([f"{entry.path}/{MARKER}", f"{entry.path}/{OWNED}"])
        if all(i.type == pyarrow.fs.FileType.File for i in marks):
            found.append((int(m.group(1)), join(location, entry.base_name)))
    return sorted(found, reverse=True)


def prune(location: str, newest: int, keep: int, endpoint: str | None = None, *,
          request_timeout_s: float = REQUEST_TIMEOUT_S) -> list[str]:
    """Delete the complete checkpoints under ``location`` older than step ``newest`` but
    the ``keep - 1`` newest of them (``newest``'s own makes ``keep``); what was deleted.
    Newer ones (another writer's) and unfinished ones (a copy under way) are left alone."""
    older = [uri for step, uri in complete(location, endpoint,
                                           request_timeout_s=request_timeout_s)
             if step < newest]
    gone = []
    for uri in older[max(keep - 1, 0):]:
        if remove(uri, endpoint, request_timeout_s=request_timeout_s):
            gone.append(uri)
    return gone
