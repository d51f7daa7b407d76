"""Samples by index from a Ray Data dataset: materialized once, read by index anywhere.

Why not stream it: a streaming split hands each reader the next block, so which rows a rank
gets depends on timing, and Ray Data cannot checkpoint a stream's position
(upstream: ray-data-stream-no-position); replica groups need sample ``i`` to be one fixed
row whichever group, node or attempt asks. So the driver runs the dataset once, in order
(``preserve_order``), and puts its rows into Ray's object store in blocks (``ray.put``: the
driver owns them and they live on its node, which the run's coordinator needs anyway). A
group's worker fetches only the blocks that hold its samples and keeps them. The files are
then read on one node only: the other nodes need none of them. The cost: the training rows
sit in the driver node's object store for the run (1 byte a token for bytes), and a worker
ends up holding the blocks it touched.

:class:`BlockRows` is the index over the blocks (Ray-free: it is given a ``fetch``
function); :func:`from_ray_dataset` and :func:`ray_samples` import Ray when called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ray_mesh.data.indexed import TokenSamples
from ray_mesh.data.spec import DataSpec
from ray_mesh.errors import DataSpecError

ROWS_PER_BLOCK = 4096  # ~0.5 MB a block of 129-byte rows: few objects, small fetches
FETCH_TIMEOUT_S = 120.0  # one fetch of blocks from the object store, at most
NODE_PIN = 0.001  # of the driver node's node:<address> resource, per read or pack task


def _ray_get(refs: list[Any]) -> list[np.ndarray]:
    import ray

    return ray.get(refs, timeout=FETCH_TIMEOUT_S)


class BlockRows:
    """Rows kept in blocks (object refs, or anything ``fetch`` resolves), fetched on first
    use and kept; pickles without the fetched blocks (the refs travel, not the data)."""

    def __init__(self, blocks: Sequence[Any], counts: Sequence[int], width: int,
                 fetch: Callable[[list[Any]], list[np.ndarray]] = _ray_get) -> None:
        if len(blocks) != len(counts) or not blocks or min(counts) < 1:
            raise DataSpecError(f"rows in blocks: {len(blocks)} blocks and {len(counts)} row "
                                f"counts (each >= 1) must match and not be empty.")
        self.blocks, self.width, self.fetch = list(blocks), width, fetch
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._got: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def take(self, rows: np.ndarray) -> np.ndarray:
        which = np.searchsorted(self.starts, rows, side="right") - 1
        missing = sorted({int(b) for b in which} - set(self._got))
        if missing:
            for b, arr in zip(missing, self.fetch([self.blocks[b] for b in missing]),
                              strict=True):
                self._got[b] = np.asarray(arr)
        out = np.empty((len(rows), self.width), dtype=self._got[int(which[0])].dtype)
        for k, (b, r) in enumerate(zip(which, rows, strict=True)):
            out[k] = self._got[int(b)][r - self.starts[b]]
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_got": {}}


def _smallest(arr: np.ndarray) -> np.ndarray:
    """Integer tokens in the narrowest unsigned type that holds them (bytes: uint8)."""
    top = int(arr.max(initial=0))
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return arr.astype(dtype)
    return arr.astype(np.int64)


def from_ray_dataset(ds: Any, column: str = "tokens", *, shuffle_seed: int = 0,
                     fingerprint: str = "", rows_per_block: int = ROWS_PER_BLOCK
                     ) -> TokenSamples:
    """A Ray Data dataset of token rows (``column``: ``(seq_len + 1,)`` integers a row),
    materialized in its order into this node's object store: :class:`TokenSamples` that
    any worker of the cluster reads by index. Call it on the driver, which must stay up
    (it owns the blocks). Sets the dataset's ``preserve_order``: the same run of the same
    dataset gives the same rows."""
    import ray

    ds.context.execution_options.preserve_order = True
    blocks, counts, width = [], [], None
    for batch in ds.iter_batches(batch_size=rows_per_block, batch_format="numpy"):
        if column not in batch:
            raise DataSpecError(f"the Ray Data dataset has no column {column!r} (columns: "
                                f"{sorted(batch)}); pass the column that holds token rows.")
        arr = np.asarray(batch[column])
        if arr.ndim != 2 or arr.shape[1] < 2 or not np.issubdtype(arr.dtype, np.integer) \
                or (arr.size and int(arr.min()) < 0):
            raise DataSpecError(f"column {column!r} must hold rows of >= 2 integer tokens "
                                f">= 0 (inputs and targets), got {arr.dtype} of shape "
                                f"{arr.shape}.")
        if width is not None and arr.shape[1] != width:
            raise DataSpecError(f"column {column!r} has rows of {width} and of {arr.shape[1]}"
                                f" tokens: pack every row to seq_len + 1.")
        width = arr.shape[1]
        if len(arr):
            blocks.append(ray.put(_smallest(arr)))
            counts.append(len(arr))
    if not blocks:
        raise DataSpecError("the Ray Data dataset gave no row: add data, or lower seq_len.")
    return TokenSamples(BlockRows(blocks, counts, int(width)), shuffle_seed=shuffle_seed,
                        fingerprint=fingerprint)


def ray_samples(spec: DataSpec) -> TokenSamples:
    """The job's training rows (``ray_mesh.data.ray_dataset``) read once through Ray Data
    on this (the driver's) node, so the other nodes need none of the files."""
    import ray

    from ray_mesh.data.text import ray_dataset

    # Ray's own per-node resource (1.0 on each node) keeps the read and pack tasks here.
    here = {f"node:{ray.util.get_node_ip_address()}": NODE_PIN}
    ds = ray_dataset(spec, "train", resources=here)
    return from_ray_dataset(ds, "tokens", shuffle_seed=spec.shuffle_seed)
