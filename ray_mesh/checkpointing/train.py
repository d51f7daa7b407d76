"""Sharded checkpoints inside a Ray Train function: save, report, resume.

:class:`Checkpointer` ties :mod:`ray_mesh.checkpointing.sharded` (DCP, Ray-free) to Ray
Train's checkpoint tracking. Ray Train (V2) accepts a multi-worker checkpoint in two ways,
and both are used:

* **direct** (storage_path is a local or shared filesystem): every rank writes its shards
  straight into ``<run dir>/checkpoint_<step>``; after a barrier rank 0 writes the marker and
  reports the directory with ``CheckpointUploadMode.NO_UPLOAD`` (Ray accepts a checkpoint
  already inside the run directory as "managed": it is listed, kept or deleted by
  ``CheckpointConfig(num_to_keep)``, and handed back by ``ray.train.get_checkpoint()``).
  Nothing is copied.
* **upload** (a cloud URI such as ``s3://``): every rank writes its shards into a local
  staging directory and every rank reports its own directory under the same
  ``checkpoint_dir_name``; Ray uploads each and merges them into one checkpoint directory
  (its documented distributed-checkpoint path). Rank 0's marker goes up with its shard.

In both, Ray registers the checkpoint only after every rank's ``report`` returned, and the
marker is written only after every rank finished writing, so what ``get_checkpoint()`` hands
back after a failure is a whole checkpoint -- and is checked again before it is loaded.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ray.train
import torch
from pyarrow.fs import LocalFileSystem
from ray.train import Checkpoint, CheckpointUploadMode

import ray_mesh.checkpointing.integrity as integrity
import ray_mesh.checkpointing.sharded as sharded
from ray_mesh.checkpointing.guards import check_args, check_report, train_context
from ray_mesh.checkpointing.sharded import CheckpointError, Progress
from ray_mesh.checkpointing.staging import StagingDir
from ray_mesh.checkpointing.storage import check_seen_by_all_ranks
from ray_mesh.core.safe import safe_text
from ray_mesh.observability.report import report

logger = logging.getLogger(__name__)


def _warn(message: str) -> None:
    # Workers' stderr reaches the driver's console (a logger there may be filtered, or
    # print the line twice through Ray's own handlers). Escaped: the message names files
    # in the run directory and quotes markers, which anyone with write access there chose.
    print(safe_text(message, multiline=True), file=sys.stderr, flush=True)


def _mesh_dict() -> dict[str, Any] | None:
    from ray_mesh.core import bootstrap

    return bootstrap.get_state().spec.to_dict() if bootstrap.is_initialized() else None


class Checkpointer:
    """Save and resume model, optimizer, step and data position from a Ray Train function.

    Args:
        model: the (FSDP2 / tensor-parallel / plain) model on the current mesh.
        optimizers: an optimizer or a list of them (or None for the model alone).
        every: save at every ``every``-th step passed to :meth:`report` (0: only when
            ``report(save=True)``).
        async_save: write with ``dcp.async_save``: the state is copied to CPU memory, the
            write runs in the background, and the checkpoint is marked complete and reported
            at the next :meth:`report` (or :meth:`close`).
        resume_from: a checkpoint directory to start from when Ray has none for this run
            (e.g. to continue another run on another mesh).
        upload: force the upload mode (True) or the direct mode (False); default: direct
            for a local/shared filesystem, upload for anything else.
        timeout_s: bound on every checkpoint collective (a dead peer fails the save within it).
        wait_committed: after reporting a checkpoint, rank 0 waits until Ray has registered
            it and the other ranks wait for rank 0, so that a failure on any rank right after
            it still resumes from it.
        check_finite: refuse to save (every rank raises ``NonFiniteError``) when a parameter
            is NaN or inf, so broken weights never rotate good checkpoints out.
        data_seed: a data-order seed (e.g. your sampler's) saved with every checkpoint;
            ``restore()`` hands back the saved one as ``Progress.data_seed`` (this one on a
            fresh start).
        diloco: the run's :class:`~ray_mesh.parallel.diloco.DiLoCo` (from
            ``ray_mesh.parallel.wrap_replicate``), or None in sync mode: each replica's model
            and optimizer state is then saved under its own key with the outer state
            (:mod:`ray_mesh.checkpointing.replicas`); a replica the checkpoint lacks (the run
            grew) starts from the global parameters.

    Each rank's random state (torch, CUDA, Python ``random``, NumPy) is saved with every
    checkpoint and restored by :meth:`restore`, so a resumed run draws the same dropout
    masks as an uninterrupted one.

    Stability: stable
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        every: int = 1,
        async_save: bool = False,
        resume_from: str | os.PathLike | None = None,
        upload: bool | None = None,
        timeout_s: float = 600.0,
        wait_committed: bool = True,
        check_finite: bool = True,
        data_seed: int | None = None,
        diloco: Any = None,
    ) -> None:
        check_args(model, optimizers, every=every, async_save=async_save, upload=upload,
                    timeout_s=timeout_s, wait_committed=wait_committed,
                    check_finite=check_finite, data_seed=data_seed, resume_from=resume_from)
        ctx = train_context()
        if diloco is not None:
            from ray_mesh.parallel.diloco import DiLoCo

            if not isinstance(diloco, DiLoCo):
                raise TypeError(f"Checkpointer(diloco=...) takes a DiLoCo (from "
                                f"ray_mesh.parallel.wrap_replicate) or None, not {diloco!r}")
        self.diloco = diloco
        self.model = model
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.optimizers = list(optimizers or [])
        self.check_finite = check_finite
        self.data_seed = data_seed
        self.every = every
        self.async_save = async_save
        self.resume_from = str(resume_from) if resume_from else None
        self.timeout_s = timeout_s
        self.wait_committed = wait_committed
        self.group = sharded.checkpoint_group(timeout_s)
        self._rank = ctx.get_world_rank()
        self._storage = ctx.get_storage()
        self.upload = (not isinstance(self._storage.storage_filesystem, LocalFileSystem)
                       if upload is None else bool(upload))
        if not self.upload:  # every rank writes its shards straight there: must be shared
            check_seen_by_all_ranks(self._storage.experiment_fs_path, self.group)
        # Private (0700, unpredictable name), per run and rank; removed by close() or when
        # this object goes away -- never a shared, guessable /tmp path (see staging.py).
        self._staging = StagingDir(ctx.get_experiment_name(), self._rank)
        self._pending: tuple[Path, Progress, Future | None] | None = None
        self._downloaded: dict[str, Path] = {}
        # One tag per attempt (rank 0's, broadcast): see sharded.dir_name.
        self._tag = sharded.broadcast_from_rank0(uuid.uuid4().hex[:6], self.group)
        self.last_reported_checkpoint: int | None = None
        """Step of the newest checkpoint handed to ray.train.report by this process."""

    # ------------------------------------------------------------------ resume
    def _candidates(self, latest: Checkpoint | None) -> list[Checkpoint]:
        """Checkpoints to try, newest first: Ray's latest, the others Ray kept, resume_from."""
        found: list[Checkpoint] = []
        if latest is not None:
            found.append(latest)
            try:
                reported = ray.train.get_all_reported_checkpoints(
                    consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
                    timeout_s=60)
            except Exception as exc:  # noqa: BLE001 - only an extra source of fallbacks
                logger.info("ray_mesh: cannot list reported checkpoints: %s", exc)
                reported = []
            others = [r.checkpoint for r in reported if r.checkpoint.path != latest.path]
            others.sort(key=lambda c: sharded.step_of(c.path) or -1, reverse=True)
            found += others
        elif self.resume_from:
            found.append(self._resume_checkpoint())
        return found

    def _resume_checkpoint(self) -> Checkpoint:
        """``resume_from`` as a Ray Checkpoint: an ``s3://`` URI without pyarrow options is
        read through this run's own filesystem when that is S3 (its endpoint included), so
        ``resume_from="s3://bucket/runs/a/checkpoint_..."`` works on a MinIO/lab server."""
        assert self.resume_from is not None
        fs = self._storage.storage_filesystem
        if (self.resume_from.startswith("s3://") and "?" not in self.resume_from
                and fs.type_name == "s3"):
            return Checkpoint(self.resume_from[len("s3://"):], filesystem=fs)
        return Checkpoint(self.resume_from)

    def _local_dir(self, checkpoint: Checkpoint) -> Path:
        """A local directory holding ``checkpoint`` (downloaded once when it is remote)."""
        if isinstance(checkpoint.filesystem, LocalFileSystem):
            return Path(checkpoint.path)
        if checkpoint.path not in self._downloaded:
            target = self._staging.path / "download" / Path(checkpoint.path).name
            if target.exists():
                shutil.rmtree(target)
            checkpoint.to_directory(str(target))
            self._downloaded[checkpoint.path] = target
        return self._downloaded[checkpoint.path]

    def _choose(self, candidates: list[Checkpoint]) -> tuple[str | None, list[str]]:
        """The newest complete candidate (rank 0 only) and a warning for each one skipped."""
        warnings: list[str] = []
        for cand in candidates:
            # Rank 0 hashes the candidate's files against the manifest (corruption that keeps
            # a file's length); only a candidate that passes is unpickled (restricted).
            why = sharded.loadable_problem(self._local_dir(cand), verify=True)
            if why is None:
                return cand.path, warnings
            warnings.append(f"ray_mesh: skipping checkpoint {cand.path}: {why}.")
        if isinstance(candidates[0].filesystem, LocalFileSystem):
            # Older complete checkpoints Ray no longer lists may still sit next door.
            found, more = sharded.newest_complete(sharded.older_siblings(candidates[0].path))
            return found, warnings + more
        return None, warnings

    def _remove_partial(self) -> None:
        """Delete checkpoint directories of this run that ray_mesh created but never finished.

        They are saves a failure interrupted: never reported (the report comes after the
        marker), so Ray does not track them and would never delete them. Only a directory
        carrying ray_mesh's ownership file is removed: one another tool wrote (e.g. a Tune
        ``checkpoint_000005``) is left alone, with a warning.
        """
        run_dir = Path(self._storage.experiment_fs_path)
        if not run_dir.is_dir():
            return
        for d in sorted(run_dir.iterdir()):
            if (sharded.step_of(d) is None or d.is_symlink() or not d.is_dir()
                    or (d / sharded.MARKER).exists()):
                continue
            if not integrity.is_owned(d):
                _warn(f"ray_mesh: leaving {d} alone: it looks like a checkpoint directory but "
                      f"ray_mesh did not create it (no {sharded.OWNED}). Move it out of the run "
                      f"directory if it does not belong there.")
                continue
            _warn(f"ray_mesh: removing partial checkpoint {d} (no {sharded.MARKER}: a "
                  f"save that a failure interrupted; it was never reported).")
            shutil.rmtree(d, ignore_errors=True)

    def restore(self) -> Progress:
        """Load the newest complete checkpoint, if any; returns where to continue.

        Rank 0 checks the candidates and picks one; every rank loads that one. A partial or
        corrupt candidate is skipped with a warning naming it. If Ray has checkpoints for this
        run but none is complete, this raises rather than silently starting from scratch.
        """
        if self._rank == 0 and not self.upload:
            self._remove_partial()
        latest = ray.train.get_checkpoint()
        if latest is None and not self.resume_from:
            return Progress(data_seed=self.data_seed)
        candidates = self._candidates(latest) if self._rank == 0 else [
            latest or self._resume_checkpoint()]
        decision = self._choose(candidates) if self._rank == 0 else None
        chosen_path, warnings = sharded.broadcast_from_rank0(decision, self.group)
        if self._rank == 0:
            for w in warnings:
                _warn(w)
        if chosen_path is None:
            raise CheckpointError(
                f"This run has checkpoints, but none is complete: {' '.join(warnings)} "
                f"Refusing to start from scratch silently: restore a complete checkpoint "
                f"directory, or start a new run (another RunConfig(name=...) or storage_path)."
            )
        chosen = Checkpoint(chosen_path, filesystem=candidates[0].filesystem)
        # Rank 0 verified the checksums while choosing; the others check sizes on shared
        # storage, and hash their own copy when it came from a bucket (what came back is
        # what gets loaded).
        verify = self._rank != 0 and not isinstance(chosen.filesystem, LocalFileSystem)
        if self.diloco is not None:
            from ray_mesh.checkpointing import replicas

            progress = replicas.load(self._local_dir(chosen), self.diloco, self.model,
                                     self.optimizers, group=self.group, verify=verify)
        else:
            progress = sharded.load(self._local_dir(chosen), self.model, self.optimizers,
                                    group=self.group, verify=verify)
        progress.path = chosen_path
        for w in progress.warnings:
            _warn(f"ray_mesh: {w}.")
        if progress.data_seed is None:
            progress.data_seed = self.data_seed
        self.data_seed = progress.data_seed
        if warnings and self._rank == 0:
            _warn(f"ray_mesh: resumed from {chosen_path} (step {progress.step}).")
        for d in self._downloaded.values():
            shutil.rmtree(d, ignore_errors=True)
        self._downloaded.clear()
        return progress

    # ------------------------------------------------------------------ save
    def _target(self, step: int) -> Path:
        name = sharded.dir_name(step, self._tag)
        if self.upload:
            return self._staging.path / name
        return Path(self._storage.build_checkpoint_path_from_name(name))

    def _start_save(self, progress: Progress) -> None:
        path = sharded.prepare_dir(self._target(progress.step), self.group,
                                   shared=not self.upload)
        if self.diloco is not None:
            from ray_mesh.checkpointing import replicas

            future = replicas.save(path, self.diloco, self.model, self.optimizers,
                                   group=self.group, async_save=self.async_save,
                                   check_finite=self.check_finite)
        else:
            future = sharded.save(path, self.model, self.optimizers, group=self.group,
                                  async_save=self.async_save, check_finite=self.check_finite)
        self._pending = (path, progress, future)

    def _finish_save(self) -> tuple[Checkpoint, Progress]:
        assert self._pending is not None
        path, progress, future = self._pending
        self._pending = None
        if future is not None:
            future.result()
        # Barrier, then rank 0 writes the marker (in upload mode into its own staging dir,
        # next to the .metadata it wrote; Ray merges the ranks' dirs on upload).
        sharded.mark_complete(path, progress, group=self.group, mesh=_mesh_dict())
        return Checkpoint.from_directory(str(path)), progress

    def report(
        self,
        step: int,
        metrics: Mapping[str, Any] | None = None,
        *,
        data_position: Mapping[str, Any] | None = None,
        save: bool | None = None,
    ) -> None:
        """``ray_mesh.report`` for ``step`` (steps done so far), with a checkpoint when due.

        Call it on every rank, once per step you report. ``data_position`` is what your data
        loader needs to continue after ``step`` (e.g. epoch and offset); it must be the same on
        every rank. ``save`` overrides ``every`` for this step.
        """
        check_report(step, data_position)
        due = save if save is not None else bool(self.every and step % self.every == 0)
        attach: tuple[Checkpoint, Progress] | None = None
        if self._pending is not None:  # an async save from an earlier step
            attach = self._finish_save()
        if due:
            self._start_save(Progress(step=step, data_position=dict(data_position or {}),
                                      data_seed=self.data_seed))
            if not self.async_save:
                attach = self._finish_save()
        self._report(dict(metrics or {}), step, attach)

    def _report(self, metrics: dict[str, Any], step: int,
                attach: tuple[Checkpoint, Progress] | None) -> None:
        metrics.setdefault("step", step)
        if attach is not None:
            metrics["checkpoint_step"] = attach[1].step
        if attach is None:
            report(metrics)
            return
        checkpoint, progress = attach
        name = sharded.dir_name(progress.step, self._tag)
        if self.upload:
            report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name,
                   checkpoint_upload_mode=CheckpointUploadMode.SYNC,
                   delete_local_checkpoint_after_upload=True)
        else:
            report(metrics, checkpoint=checkpoint if self._rank == 0 else None,
                   checkpoint_dir_name=name,
                   checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        self.last_reported_checkpoint = progress.step
        if self.wait_committed:
            if self._rank == 0:
                self._wait_committed()
            # Every rank waits for rank 0's confirmation: where no collective follows soon
            # (DiLoCo replicas between syncs), a rank dying right after its report would
            # otherwise beat the controller's poll, and the restart would use the checkpoint
            # before this one.
            sharded._barrier(self.group)

    def _wait_committed(self) -> None:
        """Block until Ray's controller has registered the checkpoint just reported.

        ``ray.train.report`` returns once the report is queued, before the controller has
        registered the checkpoint; a worker dying in between makes the restart use the
        checkpoint before this one. Rank 0 waiting here (the others wait for rank 0 in a
        barrier right after) closes that gap for one controller round trip per checkpoint.
        """
        try:
            ray.train.get_all_reported_checkpoints(
                consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED,
                timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is reported either way
            _warn(f"ray_mesh: could not confirm that Ray registered checkpoint step "
                  f"{self.last_reported_checkpoint}: {type(exc).__name__}: {exc}")

    def close(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Finish a pending async save and report it (one more ``report`` call, every rank).

        Then this rank's private staging directory (upload mode, downloads) is removed.
        """
        if self._pending is not None:
            step = self._pending[1].step
            attach = self._finish_save()
            self._report(dict(metrics or {}), step, attach)
        self._staging.cleanup()


__all__ = ["Checkpointer"]
