"""The run's fallback checkpoint, from inside a replica group: written locally, uploaded to
the run's storage in the background, restorable by a group of any layout.

The fallback is what the quorum restores when every group is gone at once (no live group
to heal from). It must outlive every node, so it goes to the run's storage (a bucket on a
tailnet without a shared filesystem, or a shared directory), and a group of any layout must
be able to read it. So it is a ray_mesh checkpoint like the one-mesh ones: DCP shards of the
group's state list (:func:`~ray_mesh.replicas.state.tensors_and_likes`), each entry with a
sharding saved as a DTensor by its global shape (DCP reshards it onto whatever layout loads
it, as the one-mesh checkpoints do), with the integrity manifest and marker
(:func:`~ray_mesh.checkpointing.sharded.mark_complete`); a restore hashes every file against
the manifest and reads the metadata through the restricted unpickler before loading.

What a save costs the group: its ranks write their shards into a private directory on the
group's node (a group is packed on one node) and hash them; then they go on. Rank 0 copies
the directory to storage in a thread (:mod:`ray_mesh.checkpointing.upload`, bounded) and only
when the copy is whole tells the coordinator (``checkpointed``), so the quorum never restores
a checkpoint that is not all there. A failed or late copy is logged and reported to the
coordinator (``checkpoint_failed``: the driver prints it); the fallback stays the previous
one. One copy at a time: a save due while the last one is still copying is skipped, with a
warning, rather than holding the group up.

Why not DCP's ``async_save`` or Ray's ``CheckpointUploadMode.ASYNC``: the local write is
the short part, and an async DCP save would run its collectives from a thread on a group of
its own on every rank; Ray's async upload writes into one group's own Ray Train run, needs
every rank of it to report, ends the group when it fails, and does not exist under torchrun.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ray_mesh.checkpointing import remote, sharded, upload
from ray_mesh.checkpointing.safe_load import load_state, single_process_ok
from ray_mesh.core import object_store
from ray_mesh.core.safe import safe_text
from ray_mesh.errors import CheckpointError, CheckpointMismatchError
from ray_mesh.replicas.coordinator import Coordinator

logger = logging.getLogger(__name__)
KEY = "replica_state.{:05d}"  # entry i of the state list (every group builds it alike)


def as_state_dict(state: list[torch.Tensor], likes: list[torch.Tensor | None]
                  ) -> dict[str, torch.Tensor]:
    """The state list for DCP: an entry with a sharding as a DTensor of its global shape
    (a view of the local shard: a load writes into it), the others as they are."""
    out = {}
    for i, (t, like) in enumerate(zip(state, likes, strict=True)):
        out[KEY.format(i)] = DTensor.from_local(
            t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
            stride=like.stride()) if isinstance(like, DTensor) else t
    return out


def _group(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


class Fallback:
    """One rank's side of the run's fallback checkpoints (see the module docstring).

    ``location``: where they go (a URI, ``s3://`` ones at ``endpoint``, or a shared
    directory); every ``every`` steps; ``keep``: how many complete ones stay in storage
    (None: all); ``upload_timeout_s`` bounds one copy. Every rank of the group makes one,
    in the same order as its other process groups (on NCCL it makes a gloo group).
    """

    def __init__(self, location: str, client: Coordinator, gid: int, *, every: int,
                 endpoint: str | None = None, keep: int | None = None,
                 upload_timeout_s: float = 600.0) -> None:
        self.location, self.endpoint, self.client, self.gid = location, endpoint, client, gid
        self.every, self.keep, self.upload_timeout_s = every, keep, upload_timeout_s
        self.group = (sharded.checkpoint_group() if dist.is_initialized()
                      and dist.get_backend() == "nccl" else None)
        self.rank = sharded._rank(self.group)
        self.shown = object_store.shown(object_store.redacted(location), endpoint)
        self._thread: threading.Thread | None = None
        self._copying: tuple[int, float] | None = None  # (step, since) of the copy under way
        self.errors: list[str] = []
        self.held_s = 0.0  # the last save's time holding the group up
        self.uploaded: dict[str, float] = {}  # the last copy: step, bytes, seconds

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: list[torch.Tensor], likes: list[torch.Tensor | None]
             ) -> bool:
        """Write ``step``'s checkpoint locally and start its upload (collective over the
        group's world); False when skipped because the last upload is still running."""
        t0 = time.perf_counter()
        plan = None
        if self.rank == 0:
            busy = self._copying
            plan = ("busy", busy[0], time.monotonic() - busy[1]) if busy else (
                tempfile.mkdtemp(prefix="ray_mesh_fallback_"), uuid.uuid4().hex[:8])
        plan = sharded.broadcast_from_rank0(plan, self.group)
        if plan[0] == "busy":
            logger.warning("replica group %s: fallback checkpoint of step %s skipped: the "
                           "upload of step %s is still running after %.0f s (uploads take "
                           "longer than checkpoint_every steps: raise it)", self.gid, step,
                           plan[1], plan[2])
            return False
        staging, tag = plan
        path = sharded.prepare_dir(Path(staging) / sharded.dir_name(step, tag), self.group)
        with single_process_ok():  # staging: uploaded, not kept
            dcp.save(as_state_dict(state, likes), process_group=self.group,
                     storage_writer=FileSystemWriter(path, sync_files=False),
                     no_dist=not dist.is_initialized())
        sharded.mark_complete(path, sharded.Progress(step=step), group=self.group,
                              mesh={"replica_group": self.gid, "ranks": _group(self.group)})
        self.held_s = time.perf_counter() - t0
        if self.rank == 0:
            self.client.checkpoint_started(step)  # the quorum keeps its books of this step
            self._copying = (step, time.monotonic())
            self._thread = threading.Thread(target=self._upload, args=(path, staging, step),
                                            daemon=True, name=f"ray_mesh-fallback-{step}")
            # At exit without close() (the group failing): no staging left in /tmp.
            weakref.finalize(self._thread, shutil.rmtree, staging, True)
            self._thread.start()
        return True

    def _upload(self, local: Path, staging: str, step: int) -> None:
        dest = upload.join(self.location, local.name)
        t0 = time.monotonic()
        try:
            size = upload.upload_dir(local, dest, self.endpoint,
                                     deadline_s=self.upload_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure: reported, never lost
            self._report(step, f"{type(exc).__name__}: {safe_text(exc, 300)}")
            try:
                upload.remove(dest, self.endpoint)  # the copy's rest: it has no marker
            except Exception as exc2:  # noqa: BLE001
                logger.warning("replica groups: %s left as it was (%s)", dest, exc2)
            return
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            self._copying = None
        self.uploaded = {"step": step, "bytes": size, "seconds": time.monotonic() - t0}
        try:
            self.client.checkpointed(step, dest)
        except Exception as exc:  # noqa: BLE001 - the quorum did not record it: say so
            self._report(step, f"uploaded, but the coordinator did not record it: {exc!r}")
            return
        if self.keep:
            try:
                upload.prune(self.location, step, self.keep, self.endpoint)
            except Exception as exc:  # noqa: BLE001 - old ones stay: storage grows, say so
                logger.warning("replica groups: fallback checkpoints older than step %s "
                               "not deleted from %s (num_to_keep=%s): %s", step, self.shown,
                               self.keep, safe_text(exc, 300))

    def _report(self, step: int, why: str) -> None:
        msg = (f"the fallback checkpoint of step {step} is not in {self.shown}: {why}. The "
               f"run's fallback stays the previous one; check the storage (endpoint, "
               f"bucket, credentials, free space)")
        self.errors.append(msg)
        logger.error("replica group %s: %s", self.gid, msg)
        try:
            self.client.checkpoint_failed(self.gid, step, msg)
        except Exception as exc:  # noqa: BLE001 - the log line above still says it
            logger.error("replica group %s: that could not be reported to the coordinator "
                         "(%r)", self.gid, exc)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the upload under way (at most ``timeout_s``, default its own bound); a
        copy still running then is reported as not saved."""
        thread, copying = self._thread, self._copying
        if thread is None or not thread.is_alive():
            return
        left = self.upload_timeout_s - (time.monotonic() - copying[1]) if copying else 0.0
        thread.join(max(1.0, left + 5.0) if timeout_s is None else timeout_s)
        if thread.is_alive() and copying is not None:
            self._report(copying[0], f"its upload was still running when the group "
                         f"finished ({time.monotonic() - copying[1]:.0f} s)")

    # ------------------------------------------------------------------ restore
    def restore(self, path: str, state: list[torch.Tensor], likes: list[torch.Tensor | None]
                ) -> None:
        """Load the checkpoint at ``path`` into ``state`` (this rank's shards, in place),
        whatever the layout that wrote it (collective over the group's world): rank 0
        copies a remote one to its node and hashes every file against the manifest."""
        local, tmp, why = None, None, None
        if self.rank == 0:
            try:
                if object_store.is_uri(path):
                    tmp = tempfile.mkdtemp(prefix="ray_mesh_fallback_get_")
                    local = str(remote.download(path, Path(tmp) / "ckpt",
                                                endpoint=self.endpoint))
                else:
                    local = path
                why = sharded.problem(local, verify=True)
            except CheckpointError as exc:
                why = str(exc)
        local, why = sharded.broadcast_from_rank0((local, why), self.group)
        try:
            if why is None:  # every rank sees the copy (the group shares its node)
                why = sharded.problem(local, verify=False)
            flag = torch.tensor([0 if why else 1], dtype=torch.int32)
            if dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            if not int(flag.item()):
                raise CheckpointError(
                    f"The fallback checkpoint {path} cannot be restored: "
                    f"{why or 'another rank of the group cannot read it'}. Every group was "
                    f"gone and this was the run's last one: start the run again (its "
                    f"storage holds older checkpoints only if num_to_keep kept them)")
            meta = sharded.checked_for_load(Path(local), verify=False)
            wanted = as_state_dict(state, likes)
            _check_matches(path, meta, wanted)
            load_state(local, wanted, meta, self.group, verified=True)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def _check_matches(path: str, meta: Any, wanted: dict[str, torch.Tensor]) -> None:
    """The checkpoint holds this group's state list (names, global shapes, dtypes)."""
    saved = meta.state_dict_metadata
    diffs = [f"{k} missing" for k in wanted if k not in saved]
    diffs += [f"{k} not in this model" for k in saved if k not in wanted]
    for k in wanted:
        info = saved.get(k)
        if isinstance(info, TensorStorageMetadata) and (
                tuple(info.size) != tuple(wanted[k].shape)
                or info.properties.dtype != wanted[k].dtype):
            diffs.append(f"{k}: saved {tuple(info.size)} {info.properties.dtype}, here "
                         f"{tuple(wanted[k].shape)} {wanted[k].dtype}")
    if diffs:
        raise CheckpointMismatchError(
            f"The fallback checkpoint {path} holds another model's state ({len(saved)} "
            f"tensors saved, {len(wanted)} here; {'; '.join(diffs[:4])}): start the run "
            f"again with the model that wrote it, or under another name")
