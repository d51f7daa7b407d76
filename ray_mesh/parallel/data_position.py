"""An exact data position for a map-style dataset: resume mid-epoch, also on another dp size.

``torch.utils.data.DistributedSampler`` restarts every epoch from its first sample, so a run
resumed from a mid-epoch checkpoint reads again what it had already trained on (or, when the
loop skips batches itself, skips by a per-rank count that is wrong once the dp size changed).
:class:`ResumableSampler` yields the same order as ``DistributedSampler`` (same permutation
for ``seed + epoch``, same padding or truncation, rank ``r`` takes every ``dp``-th index) and
keeps a position that does not depend on the dp size: the number of samples of the epoch's
order consumed by all ranks together. In that strided order, after ``k`` samples on each of
``dp`` ranks, the consumed samples are exactly the first ``k * dp`` of the epoch's order,
so a resume hands out the rest, strided over the *new* dp size: nothing is read twice and
nothing is skipped, whatever the dp size was before.

The position is a small dict (``{"epoch", "consumed"}``), the same on every rank, made for
``Checkpointer.report(..., data_position=...)``. Plain torch, no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from ray_mesh.errors import ParallelError


@dataclass(frozen=True)
class SamplerPosition:
    """Where an epoch stands: ``consumed`` samples of epoch ``epoch``'s order, all ranks."""

    epoch: int = 0
    consumed: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SamplerPosition:
        if not data:
            return cls()
        try:
            pos = cls(epoch=int(data["epoch"]), consumed=int(data["consumed"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParallelError(
                f"Not a sampler position: {dict(data)!r}. Pass what ResumableSampler.position() "
                f"returned (a dict with 'epoch' and 'consumed'), or None to start afresh."
            ) from exc
        if pos.epoch < 0 or pos.consumed < 0:
            raise ParallelError(f"A sampler position is never negative, got {pos}.")
        return pos


def epoch_order(num_samples: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """The epoch's sample order before padding: ``DistributedSampler``'s permutation."""
    if not shuffle:
        return list(range(num_samples))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def fit_to(indices: list[int], num_replicas: int, drop_last: bool) -> list[int]:
    """Pad (repeating from the start, like ``DistributedSampler``) or cut to a multiple."""
    if drop_last:
        return indices[: len(indices) // num_replicas * num_replicas]
    total = math.ceil(len(indices) / num_replicas) * num_replicas
    if not indices:
        return []
    reps = math.ceil(total / len(indices))
    return (indices * reps)[:total]


class ResumableSampler(Sampler[int]):
    """``DistributedSampler`` over ``num_replicas`` dp ranks that resumes at an exact position.

    Args:
        dataset: a sized dataset, or its length.
        num_replicas: the dp size (not the world size: tp, cp and pp peers share a dp index
            and must read the same samples).
        rank: this rank's dp index (not the world rank, for the same reason).
        shuffle: as in ``DistributedSampler``.
        seed: as in ``DistributedSampler``.
        drop_last: as in ``DistributedSampler``.
        position: what :meth:`position` returned before (None: epoch 0, from the start).

    In the loop, call :meth:`advance` with the number of samples this rank has trained on
    (once per batch), and put :meth:`position` into the checkpoint. ``set_epoch(e)`` starts
    epoch ``e`` from its beginning, except the epoch of the position it was built with,
    which starts where that position says.

    Stability: experimental
    """

    def __init__(self, dataset: Sized | int, num_replicas: int, rank: int, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 position: Mapping[str, Any] | None = None) -> None:
        self.num_samples_total = dataset if isinstance(dataset, int) else len(dataset)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ParallelError(f"rank {rank} is not a dp index of num_replicas={num_replicas}: "
                                f"pass the dp size and dp rank (ray_mesh.parallel.dp_size, "
                                f"dp_rank).")
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        start = SamplerPosition.from_dict(position)
        self._resume = start
        self.epoch = start.epoch
        self._start = start.consumed  # samples of this epoch's order consumed before
        self._done = 0  # samples this rank consumed since then (advance)

    # ------------------------------------------------------------------ order
    def _remaining(self) -> list[int]:
        """This epoch's order after what was consumed, padded or cut for this dp size."""
        order = epoch_order(self.num_samples_total, self.epoch, shuffle=self.shuffle,
                            seed=self.seed)
        # The consumed prefix is taken from the order as the run that consumed it padded it;
        # its length alone is what counts, and it never exceeds the padded length.
        return fit_to(order[self._start:], self.num_replicas, self.drop_last) \
            if self._start < len(order) else []

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return len(self._remaining()) // self.num_replicas

    # ------------------------------------------------------------------ position
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: from its beginning, or from the resumed position for its epoch."""
        self.epoch = epoch
        self._start = self._resume.consumed if epoch == self._resume.epoch else 0
        self._done = 0

    def advance(self, samples: int) -> None:
        """Count ``samples`` more samples trained on by this rank (and by every dp rank)."""
        if samples < 0:
            raise ParallelError(f"advance() takes the samples consumed, got {samples}.")
        self._done += samples

    def position(self) -> dict[str, int]:
        """The position after what :meth:`advance` counted: the same dict on every rank."""
        consumed = self._start + self._done * self.num_replicas
        return SamplerPosition(self.epoch, consumed).to_dict()


__all__ = ["ResumableSampler"]
