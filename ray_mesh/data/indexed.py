"""Training samples by index: sample ``i`` of a job's ``data:``, the same on every node.

Why: replica groups hand out samples as index ranges (``rg.sample_ids``), and the run's
books promise that every index is used once, across a group leaving, rejoining and a
restore. That promise is about the data only if index ``i`` means the same sequence in
every group, on every node and in every attempt. So the mapping from an index to its
tokens here depends on the files and the ``data:`` section alone: not on where a node keeps
the files (paths are compared by their last components), not on numpy's random generators
(whose streams may change between versions), not on how a streaming read was split.

* :class:`TokenSamples` is map-style: ``samples[i]`` is the ``i``-th training sequence of
  ``seq_len + 1`` tokens (int64), ``samples.batch(ids)`` a ``(len(ids), seq_len + 1)``
  tensor. :meth:`TokenSamples.from_spec` reads the training split on this node (each node
  its own copy of the files, e.g. Python's standard library sources, no shared file
  system); :mod:`.indexed_ray` serves rows a driver put into Ray's object store instead.
* The training files are read in a seeded order (a hash of each file's last three path
  components), cut at ``max_tokens``, and packed into rows of ``seq_len + 1``; the
  validation files stay out, held out exactly as for a one-mesh job
  (:meth:`~ray_mesh.data.spec.DataSpec.split`).
* **Indices past the end wrap, epoch after epoch**: index ``i`` is row
  ``order(e)[i % n]`` of epoch ``e = i // n``, a fresh permutation of the ``n`` rows per
  epoch made by integer hashing (:func:`epoch_order`), so a long run sees every row once
  per epoch in a new order, and every node computes the same order.
* :func:`manifest`: what the indices mean, as a short hash (the training files' names and
  sizes in their order, and the keys that cut them into rows). The driver computes it
  before Ray starts; a node whose files differ (another Python's standard library, a file
  missing) refuses to train instead of training on other samples under the same indices.

Ray-free.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from ray_mesh.data.spec import DataSpec
from ray_mesh.data.text import read_tokens
from ray_mesh.errors import DataSpecError

INDEX_KEY = "data_index"
"""The train function's config key for how its samples are read (``manifest``, or the rows
in Ray's object store as ``samples``), set by ``ray-mesh run`` for replica groups."""
_MASK = (1 << 64) - 1


class Rows(Protocol):
    """Where the rows of one epoch live: ``len`` rows of ``width`` tokens each."""

    width: int

    def __len__(self) -> int: ...

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The rows at these positions, ``(len(rows), width)``, any integer dtype."""
        ...


class LocalRows:
    """Rows in this process's memory: a ``(n, width)`` array (uint8 for bytes: 1 byte a
    token, so the whole standard library is ~31 MB per process)."""

    def __init__(self, table: np.ndarray) -> None:
        if table.ndim != 2 or table.shape[1] < 2:
            raise DataSpecError(f"rows must be a 2-D array of at least 2 tokens a row (inputs "
                                f"and next-token targets), got shape {table.shape}.")
        self.table, self.width = table, int(table.shape[1])

    def __len__(self) -> int:
        return int(self.table.shape[0])

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.table[rows]


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 of each uint64: integer arithmetic only, identical on every machine."""
    x = values.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of ``n`` rows in ``epoch``: a permutation from hashing (not a random
    generator's stream, which numpy does not promise to keep between versions)."""
    key = _mix(np.array([(seed * 1_000_003 + epoch) & _MASK], dtype=np.uint64))
    return np.argsort(_mix(np.arange(n, dtype=np.uint64) ^ key), kind="stable")


def _tail(path: Path) -> str:
    # The last three components: the same name on nodes that keep the files elsewhere.
    return "/".join(path.parts[-3:])


def train_files(spec: DataSpec) -> list[Path]:
    """The training split's files in reading order (seeded by ``shuffle_seed``)."""
    train, _ = spec.split()
    return sorted(train, key=lambda p: (hashlib.sha1(
        f"order:{spec.shuffle_seed}:{_tail(p)}".encode()).hexdigest(), _tail(p), str(p)))


def files_read(spec: DataSpec, files: Sequence[Path]) -> list[Path]:
    """The prefix of ``files`` that ``max_tokens`` reads: exact for text (a file gives its
    size plus one separator in tokens); every file for jsonl/parquet (only reading tells)."""
    if spec.max_tokens is None or spec.format != "text":
        return list(files)
    total = 0
    for n, path in enumerate(files, 1):
        total += path.stat().st_size + 1
        if total >= spec.max_tokens:
            return list(files[:n])
    return list(files)


def manifest(spec: DataSpec, files: Sequence[Path] | None = None) -> str:
    """What sample ``i`` means, as 16 hex digits: the files read (last path components and
    sizes, in order) and the keys that cut them into rows. Equal on two nodes: the same
    samples (unless a file changed without changing its size)."""
    files = files_read(spec, train_files(spec) if files is None else files)
    what = {"files": [[_tail(p), p.stat().st_size] for p in files],
            "cut": [spec.format, spec.text_key, spec.seq_len, spec.max_tokens,
                    spec.shuffle_seed]}
    return hashlib.sha1(json.dumps(what).encode()).hexdigest()[:16]


class TokenSamples:
    """Map-style training samples by index (see the module docstring).

    Args:
        rows: one epoch's rows (:class:`LocalRows`, or the object store's rows).
        shuffle_seed: seeds each epoch's order (:func:`epoch_order`).
        fingerprint: the :func:`manifest` these rows were read for ("" when unknown).
    """

    def __init__(self, rows: Rows, *, shuffle_seed: int = 0, fingerprint: str = "") -> None:
        if len(rows) < 1:
            raise DataSpecError("data: no training row to sample from. Add data to "
                                "data.paths, or lower data.seq_len.")
        self.rows, self.shuffle_seed, self.fingerprint = rows, shuffle_seed, fingerprint
        self._orders: dict[int, np.ndarray] = {}

    @classmethod
    def from_spec(cls, spec: DataSpec, *, expect: str | None = None) -> TokenSamples:
        """The training samples of ``spec``, read from this node's files. ``expect``: the
        driver's :func:`manifest`; files that give another one are refused with the fix."""
        files = files_read(spec, train_files(spec))
        got = manifest(spec, files)
        if expect is not None and got != expect:
            raise DataSpecError(
                f"data: this node's training files differ from the driver's (manifest {got}, "
                f"the driver's {expect}: other file names or sizes), so sample indices would "
                f"mean other data here. Put the same files on every node (the 'stdlib' "
                f"sources differ between Python versions), or set replica_groups.data_from: "
                f"ray_data to read them once on the driver.")
        tokens = read_tokens(files, spec.format, spec.text_key, spec.max_tokens)
        row = spec.seq_len + 1
        n = len(tokens) // row
        if n < 1:
            raise DataSpecError(f"data: the training split gives no row of {row} tokens "
                                f"({len(tokens)} tokens read). Add data or lower seq_len.")
        return cls(LocalRows(tokens[:n * row].reshape(n, row)),
                   shuffle_seed=spec.shuffle_seed, fingerprint=got)

    def __len__(self) -> int:
        """Rows in one epoch (indices go on past it: the next epoch, in a new order)."""
        return len(self.rows)

    @property
    def seq_len(self) -> int:
        """Input tokens of a sample (a row holds one more: the last target)."""
        return self.rows.width - 1

    def row_of(self, ids: Iterable[int]) -> np.ndarray:
        """The epoch row behind each sample index (the wrap-around and per-epoch order)."""
        idx = np.fromiter((_index(i) for i in ids), dtype=np.int64)
        n = len(self.rows)
        epochs, pos = np.divmod(idx, n)
        out = np.empty_like(idx)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._order(int(e))[pos[sel]]
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs: keep the last two
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(len(self.rows), self.shuffle_seed, epoch)
        return self._orders[epoch]

    def batch(self, ids: Sequence[int]) -> torch.Tensor:
        """``(len(ids), seq_len + 1)`` int64: the samples ``ids``, in that order."""
        if len(ids) == 0:
            return torch.zeros(0, self.rows.width, dtype=torch.int64)
        return torch.from_numpy(np.asarray(self.rows.take(self.row_of(ids)), dtype=np.int64))

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batch([i])[0]


def _index(i: Any) -> int:
    if isinstance(i, bool) or not isinstance(i, int | np.integer):
        raise IndexError(f"a sample index is a whole number >= 0 (from rg.sample_ids), got "
                         f"{type(i).__name__} {i!r}.")
    if i < 0 or i >= 2**62:
        raise IndexError(f"sample index {i} is out of range: indices count up from 0 "
                         f"(those past the data's end wrap to the next epoch).")
    return int(i)


def group_samples(config: Mapping[str, Any]) -> TokenSamples:
    """In a replica group's train function: the job's training samples by index.

    ``config["data"]`` is the checked ``data:`` section and ``config["data_index"]`` how to
    read it, both set by ``ray-mesh run`` for a job with ``replica_groups:`` and ``data:``:
    the rows the driver put in Ray's object store (``replica_groups.data_from: ray_data``),
    or this node's files checked against the driver's :func:`manifest` (the default).
    """
    index = config.get(INDEX_KEY) or {}
    if index.get("samples") is not None:
        return index["samples"]
    if config.get("data") is None:
        raise DataSpecError("This train function reads samples by index from the job's data: "
                            "section, and its config has none. Add a data: section to the "
                            "job (paths, seq_len, ...).")
    return TokenSamples.from_spec(DataSpec.from_dict(config["data"]),
                                  expect=index.get("manifest"))
