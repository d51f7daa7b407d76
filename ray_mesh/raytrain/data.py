"""Ray Data on a mesh: split by data-parallel rank, identical batches for tp/cp/pp peers.

Ray Train's default ``DataConfig`` calls ``streaming_split(world_size, equal=True)``: every
world rank gets different rows, so tensor-, context- and pipeline-parallel peers, which
compute one batch together, would silently train on different rows. Ray has no mesh-aware
split (upstream: ray-data-no-mesh-split), and one split iterator shared by several workers
does not replicate data (its coordinator hands each ``get`` the next block).
:class:`MeshDataConfig` therefore runs one ``streaming_split(dp, equal=True)`` per peer
position (``pp * cp * tp`` of them), each with ``preserve_order=True``: worker (dp index
``d``, peer ``j``) reads split ``d`` of execution ``j``. Ray's ``OutputSplitter`` hands each
block to the split with the fewest rows so far (ties to the lowest index), a decision that
depends only on the order and sizes of the blocks; with the order preserved and a
deterministic dataset (seeded shuffles), every execution splits identically, so peers see
the same batches in the same order. The price: the dataset is read ``pp * cp * tp`` times
(once per peer), streaming, never materialised.

The split becomes automatic with ``MeshConfig``: its backend calls
:func:`install_mesh_data_config`, which puts a :class:`MeshDataConfig` in place of a plain
``DataConfig`` and refuses, before any process group, a user's own ``DataConfig`` that would
split by world rank while tp*cp*pp > 1. ``dataset_config=ray_mesh.MeshDataConfig(...)`` is
the explicit, public spelling.

:class:`ResumableShard` wraps a shard so that a run resumed from a checkpoint continues each
epoch exactly where the checkpoint was taken: Ray Data cannot checkpoint a split's position
itself (upstream: ray-data-stream-no-position).
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import ray
from ray.train import DataConfig

from ray_mesh import private_apis
from ray_mesh.core.spec import MeshSpec
from ray_mesh.errors import DataSplitError

logger = logging.getLogger(__name__)


def peer_count(spec: MeshSpec) -> int:
    """How many ranks share one dp index (and must read identical batches): pp*cp*tp."""
    return spec.size("pp") * spec.size("cp") * spec.size("tp")


def split_ranks(spec: MeshSpec) -> list[tuple[int, int]]:
    """For every world rank of a resolved spec: (dp index, peer index).

    The dp index is the flattened ``dp`` coordinate (dp_replicate x dp_shard); the peer
    index enumerates the (pp, cp, tp) coordinate, so ranks with equal dp index and distinct
    peer index are exactly the ranks that must see the same data.
    """
    out = []
    for rank in range(spec.world_size):
        c = spec.coordinate(rank)
        out.append((c["dp"], (c["pp"] * spec.size("cp") + c["cp"]) * spec.size("tp") + c["tp"]))
    return out


class MeshDataConfig(DataConfig):
    """A ``DataConfig`` that splits datasets by dp rank and replicates them over peers.

    Args:
        mesh: the run's mesh (a ``MeshSpec``, a dict, or a shorthand); None lets
            ``MeshConfig``'s backend fill it in when the workers start.
        datasets_to_split: as in ``DataConfig``.
        execution_options: as in ``DataConfig``. ``preserve_order`` is always set:
            deterministic splits need it (it also turns Ray's locality hints off).
        enable_shard_locality: as in ``DataConfig``.

    Stability: stable
    """

    def __init__(self, mesh: Any = None, datasets_to_split: Any = "all",
                 execution_options: Any = None, enable_shard_locality: bool = True) -> None:
        super().__init__(datasets_to_split=datasets_to_split,
                         execution_options=execution_options,
                         enable_shard_locality=enable_shard_locality)
        self.mesh = None if mesh is None else MeshSpec.from_dict(mesh)
        self._split = datasets_to_split
        self._options = execution_options

    def with_mesh(self, mesh: MeshSpec) -> MeshDataConfig:
        """A copy of this config on ``mesh``."""
        out = copy.copy(self)
        out.mesh = mesh
        return out

    def _execution_options(self, name: str) -> Any:
        opts = self._options.get(name) if isinstance(self._options, dict) else self._options
        opts = copy.deepcopy(opts or self.default_ingest_options())
        opts.preserve_order = True
        return opts

    def resolved_mesh(self, world_size: int, worker_node_ids: list | None) -> MeshSpec:
        if self.mesh is None:
            raise DataSplitError(
                "MeshDataConfig has no mesh. Pass torch_config=ray_mesh.MeshConfig(...) to the "
                "trainer (its backend fills the mesh in), or MeshDataConfig(mesh=...)."
            )
        nodes = len(set(worker_node_ids)) if worker_node_ids else None
        try:
            return self.mesh.resolve(world_size, num_nodes=nodes)
        except ValueError as exc:
            raise DataSplitError(f"MeshDataConfig(mesh={self.mesh}) does not fit the "
                                 f"{world_size} workers: {exc}") from exc

    def configure(self, datasets: dict, world_size: int, worker_handles: list | None,
                  worker_node_ids: list | None, **kwargs: Any) -> list[dict]:
        spec = self.resolved_mesh(world_size, worker_node_ids)
        rank_of = {pos: rank for rank, pos in enumerate(split_ranks(spec))}
        dp, peers = spec.size("dp"), peer_count(spec)
        split = set(datasets) if self._split == "all" else set(self._split)
        output: list[dict] = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            if ds.name is None:
                ds.set_name(name)
            ds = ds.copy(ds)
            ds.context.execution_options = self._execution_options(name)
            if name not in split:
                for i in range(world_size):
                    output[i][name] = ds.iterator()
                continue
            for peer in range(peers):
                ranks = [rank_of[(d, peer)] for d in range(dp)]
                hints = ([worker_node_ids[r] for r in ranks]
                         if self._enable_shard_locality and worker_node_ids else None)
                for d, it in enumerate(ds.streaming_split(dp, equal=True,
                                                          locality_hints=hints)):
                    output[ranks[d]][name] = it
        return output


def mesh_data_config(current: DataConfig, spec: MeshSpec) -> DataConfig:
    """The ``DataConfig`` a run on ``spec`` should use instead of ``current``.

    A plain ``DataConfig`` becomes a :class:`MeshDataConfig` with the same settings; a
    ``MeshDataConfig`` gets the mesh; a user's own subclass is kept when every rank is its
    own dp rank (tp*cp*pp == 1) and refused otherwise, since it splits by world rank.
    """
    if isinstance(current, MeshDataConfig):
        if current.mesh is not None and current.mesh.is_resolved and current.mesh != spec:
            raise DataSplitError(
                f"dataset_config=MeshDataConfig(mesh={current.mesh}) differs from the run's "
                f"mesh {spec}. Pass MeshDataConfig() without a mesh (the run's is used), or the "
                f"same mesh as MeshConfig's."
            )
        return current.with_mesh(spec)
    if type(current) is DataConfig:
        return MeshDataConfig(spec, *private_apis.data_config_settings(current))
    if peer_count(spec) == 1:
        return current
    raise DataSplitError(
        f"dataset_config={type(current).__name__}(...) is a custom DataConfig, which Ray Train "
        f"uses to split the datasets by world rank; on the mesh {spec} the "
        f"{peer_count(spec)} tp/cp/pp peers of each dp rank would then read different rows. "
        f"Make it a subclass of ray_mesh.MeshDataConfig (or pass "
        f"dataset_config=ray_mesh.MeshDataConfig(...)), which splits by dp rank and gives the "
        f"peers identical batches; or split by ray_mesh.parallel.dp_rank yourself and pass "
        f"DataConfig(datasets_to_split=[]) so Ray does not split."
    )


def install_mesh_data_config(worker_group: Any, spec: MeshSpec) -> None:
    """Called by ``MeshConfig``'s backend: make the run's datasets follow ``spec``.

    Raises :class:`DataSplitError` (before any process group) for a custom ``DataConfig``
    that cannot be made right.
    """
    try:
        outcome = private_apis.replace_run_data_config(
            worker_group, lambda cfg: mesh_data_config(cfg, spec))
    except DataSplitError:
        raise
    except Exception as exc:  # an internal that moved: say how to do without it
        raise DataSplitError(
            f"ray_mesh could not install its mesh-aware DataConfig in this Ray "
            f"({ray.__version__}; checked on {private_apis.CHECKED_RAY}): "
            f"{type(exc).__name__}: {exc}. Pass "
            f"dataset_config=ray_mesh.MeshDataConfig(mesh=<the MeshConfig's mesh>) to the "
            f"trainer."
        ) from exc
    if outcome == "late":
        raise DataSplitError("The datasets were split before the mesh was up; this is a "
                             "ray_mesh bug: pass dataset_config=ray_mesh.MeshDataConfig("
                             "mesh=...) explicitly.")
    if outcome != "none" and peer_count(spec) > 1:
        logger.info("ray_mesh: datasets split over dp=%d, each split read by %d peers",
                    spec.size("dp"), peer_count(spec))



# ----------------------------------------------------------------------------- position
def _rows(batch: Any) -> int:
    if isinstance(batch, Mapping):
        return len(next(iter(batch.values()))) if batch else 0
    return len(batch)


class ResumableShard:
    """A dataset shard that knows its position in the epoch, and resumes there exactly.

    Wrap ``ray.train.get_dataset_shard(name)``; each ``iter_batches`` /
    ``iter_torch_batches`` call is one epoch. :meth:`position` (after the batch you trained
    on) goes into the checkpoint; a shard built with that position skips, in its first
    epoch, exactly the batches that position counts, so each dp rank continues with the
    sample after the last one it trained on. Exact because :class:`MeshDataConfig` makes
    the split deterministic (same blocks to the same dp rank in the same order; a shuffle
    in the dataset needs a seed). The skipped batches are read again: resuming costs the
    reading, not the training, of the part of the epoch already done.

    A position saved on another dp size cannot be exact (the split of the epoch changes):
    the shard warns and skips the same fraction of the epoch. Use
    ``ray_mesh.parallel.resumable_sampler`` for exact resumes across dp sizes.

    Stability: experimental
    """

    def __init__(self, iterator: Any, position: Mapping[str, Any] | None = None, *,
                 dp_size: int | None = None) -> None:
        self.iterator = iterator
        self.dp_size = dp_size or _mesh_dp_size()
        pos = dict(position or {})
        self.epoch = int(pos.get("epoch", 0))
        self.batches = 0
        self.rows = 0
        self._skip_rows = int(pos.get("rows", 0))
        saved_dp = int(pos.get("dp_size", self.dp_size))
        if self._skip_rows and saved_dp != self.dp_size:
            print(f"ray_mesh: the data position was saved with dp={saved_dp}, this run has "
                  f"dp={self.dp_size}; Ray Data splits the epoch differently, so resuming "
                  f"epoch {self.epoch} skips the same fraction of it, not the same samples "
                  f"(some may repeat or be skipped). ray_mesh.parallel.resumable_sampler "
                  f"resumes exactly across dp sizes.", file=sys.stderr, flush=True)
            self._skip_rows = self._skip_rows * saved_dp // self.dp_size
        self._approximate = saved_dp != self.dp_size
        self._started = False
        self._complete = False

    def iter_batches(self, **kwargs: Any) -> Iterator[Any]:
        """One epoch of ``DataIterator.iter_batches(**kwargs)``, resumed where it was."""
        return self._epoch(self.iterator.iter_batches(**kwargs))

    def iter_torch_batches(self, **kwargs: Any) -> Iterator[Any]:
        """One epoch of ``DataIterator.iter_torch_batches(**kwargs)``, resumed where it was."""
        return self._epoch(self.iterator.iter_torch_batches(**kwargs))

    def _epoch(self, batches: Iterator[Any]) -> Iterator[Any]:
        if self._started:  # the previous epoch ended (or was left): this is the next one
            self.epoch += 1
            self._skip_rows = 0
        self._started, self._complete = True, False
        self.batches = self.rows = 0
        skip = self._skip_rows
        for batch in batches:
            n = _rows(batch)
            self.batches += 1
            self.rows += n
            if self.rows <= skip:
                continue
            if self.rows - n < skip and not self._approximate:
                raise DataSplitError(
                    f"Cannot resume exactly: the checkpoint's position ends after row {skip} of "
                    f"this epoch, inside a batch of rows {self.rows - n}..{self.rows - 1}. Use the "
                    f"batch size of the run that saved it."
                )
            yield batch
        self._complete = True

    def position(self) -> dict[str, int]:
        """Where this rank stands (the same on every rank of an equal split)."""
        if self._complete:
            return {"epoch": self.epoch + 1, "batches": 0, "rows": 0, "dp_size": self.dp_size}
        return {"epoch": self.epoch, "batches": self.batches, "rows": self.rows,
                "dp_size": self.dp_size}


def _mesh_dp_size() -> int:
    from ray_mesh.core import bootstrap

    return bootstrap.get_state().spec.size("dp") if bootstrap.is_initialized() else 1


__all__ = ["MeshDataConfig", "ResumableShard"]
