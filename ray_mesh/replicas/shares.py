"""How many samples each replica group gets per segment: equal, or by measured speed.

On unequal boxes (a faster GPU, more devices in one group, a node under load) equal
segments make every boundary wait for the slowest group. Split by speed, each group's
batch is sized so that all groups finish their cycle at about the same time; the averages
weigh each contribution by its samples, so the update is still the mean over the
boundary's samples.

A group's cycle is a fixed part plus its samples over its compute rate. The fixed part is
the boundary's own work: the exchange, the optimizer step, and meeting the quorum (the call
to the coordinator, the decision's way to its ranks), but not the wait for the other groups
(the quorum says how long that was: ``Decision.waited_s``). These seconds do not depend on
the batch, and a slow box pays more for them. The split solves for equal cycles:
``fixed_i + n_i / rate_i = T`` with the ``n_i`` summing to the boundary's total. A split by
compute rate alone would hand a slow box with a costly boundary too many samples, and
everyone would wait for it; a split by whole-cycle speed (samples over everything) would
hand it too few, since its speed measured at a small batch is mostly the fixed part.

Both parts are medians of the last :data:`WINDOW` segments the group reports on arrival
(:class:`Pace`). A median, not a running mean, because a box's segments are not all alike:
one hiccup (a collection, a scheduler stall on a busy box) would otherwise move the split
for several steps, and every step waits for the last group. The first segment after a
group joins is not counted at all: it holds one-off costs (the first forward and backward,
buffers allocated, the first collective's connections) that would make the box look slow
and starve it of samples while its estimate recovers. Pure functions: the quorum calls
them under its lock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

SHARES = ("equal", "speed")
WINDOW = 5  # a group's pace is the median of its last WINDOW segments


@dataclass
class Pace:
    """A group's measured pace: compute rate (samples/s) and a boundary's fixed seconds,
    each the median of its last :data:`WINDOW` segments; the first segment is warm-up."""

    rate: float | None = None
    fixed_s: float | None = None
    warm: bool = False  # the first measured segment (warm-up) has been seen and left out
    _rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)
    _fixed: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)

    def update(self, samples: int, compute_s: float | None, fixed_s: float | None) -> None:
        """Fold in one segment: ``samples`` computed in ``compute_s``, after a boundary whose
        own work took ``fixed_s`` (None: not measured, e.g. a heal's one-off transfer)."""
        if compute_s is not None and compute_s > 0 and samples > 0:
            if self.warm:
                self._rates.append(samples / compute_s)
                self.rate = statistics.median(self._rates)
            self.warm = True
        if fixed_s is not None and fixed_s >= 0:
            self._fixed.append(fixed_s)
            self.fixed_s = statistics.median(self._fixed)

    @property
    def settled(self) -> bool:
        """A whole window of compute rates measured: one segment no longer moves them."""
        return len(self._rates) == WINDOW

    def speed(self, samples: int) -> float | None:
        """Samples/s of a whole cycle at ``samples`` per segment (what status shows)."""
        if not self.rate or samples <= 0:
            return self.rate
        return samples / ((self.fixed_s or 0.0) + samples / self.rate)


def inner_steps(ids: list[int], per_rank: int, segment: int, every: int, ranks: int
                ) -> list[list[int]]:
    """A DiLoCo group's round as inner steps: this rank's ``ids`` (of ``per_rank``, the most
    any rank of the group holds, so that every rank takes the same number of steps) in
    batches of an equal share's step, ``segment / every`` over the group's ``ranks``.

    A step's time is a fixed part (the optimizer step, the group's own collectives, a
    launch) plus its samples; with ``every`` steps per round whatever the share, a slow box
    that the speed split gives few samples pays ``every`` fixed parts for them, its compute
    rate falls as its share falls, and the split chases it over many rounds. With steps of
    one size, a round's compute is proportional to its samples, so the rate measured at one
    share holds at the next: a faster group takes more inner steps (as Dynamic Local Updates
    in asynchronous Local-SGD do), and no step of a small share is empty."""
    batch = max(1, -(-segment // (every * max(1, ranks))))
    count = max(1, -(-per_rank // batch))
    return [ids[k * batch:(k + 1) * batch] for k in range(count)]


def check_mode(mode: str) -> None:
    """Refuse a ``shares`` value that is not one of :data:`SHARES`, naming the choices."""
    if mode not in SHARES:
        raise ValueError(f"shares={mode!r}: use one of {SHARES} (\"speed\" sizes each "
                         "group's batch to its measured speed)")


def _parts(groups: dict[int, tuple]) -> tuple[dict[int, int], dict[int, float],
                                               dict[int, float]]:
    """``groups`` (id -> ranks, rate or None[, fixed_s]) as three maps: ranks, compute rate
    (samples/s, a tiny positive floor for none) and a boundary's fixed seconds (0 if none)."""
    return ({gid: g[0] for gid, g in groups.items()},
            {gid: max(float(g[1] or 0.0), 1e-9) for gid, g in groups.items()},
            {gid: float(g[2] or 0.0) if len(g) > 2 else 0.0 for gid, g in groups.items()})


def split_samples(segment: int, groups: dict[int, tuple], mode: str = "equal"
                  ) -> dict[int, int]:
    """Samples per group for the next segment. ``groups``: id -> (ranks, rate or None[,
    fixed_s]): its rank count, compute rate (samples/s) and a boundary's fixed seconds.

    ``"equal"``, or any group without a measured rate yet: ``segment`` each. ``"speed"``:
    the same total (``segment`` times the groups) split so that every group's cycle,
    ``fixed_s + samples / rate``, takes the same time (with no fixed part: in proportion
    to rate); in whole multiples of each group's rank count (its data-parallel ranks get
    equal batches), at least one sample per rank. What rounding leaves goes to the largest
    remainders, then to any group whose rank count still fits (2-rank groups next to a
    1-rank one: no sample of the total is left over)."""
    check_mode(mode)
    if mode == "equal" or any(g[1] is None for g in groups.values()):
        return {gid: segment for gid in groups}
    total = segment * len(groups)
    ranks, rate, fixed = _parts(groups)
    # Each group's minimum, in units of its ranks: one sample per rank, and at least half
    # its share by compute rate alone, so that a noisy fixed-cost estimate cannot starve it
    # (without it, a busy head node's slow boundary can pin a group at one sample per rank).
    whole = sum(rate.values())
    least = {g: max(1.0, total * rate[g] / whole / ranks[g] / 2) for g in groups}
    floor: set[int] = set()  # groups held at their minimum
    while True:
        free = [gid for gid in groups if gid not in floor]
        left_total = total - sum(least[g] * ranks[g] for g in floor)
        cycle = (left_total + sum(fixed[g] * rate[g] for g in free)) / sum(
            rate[g] for g in free) if free else 0.0
        exact = {g: rate[g] * (cycle - fixed[g]) / ranks[g] for g in free}  # units of ranks
        low = {g for g, x in exact.items() if x < least[g]}
        if not low or len(low) == len(free):
            break
        floor |= low
    exact = {**{g: max(x, least[g]) for g, x in exact.items()},
             **{g: least[g] for g in floor}}
    out: dict[int, int] = {}
    rest: list[tuple[float, int]] = []
    for gid, x in exact.items():
        out[gid] = max(1, int(x)) * ranks[gid]
        rest.append((x - int(x), gid))
    left = total - sum(out.values())
    order = [gid for _, gid in sorted(rest, reverse=True)]
    while left > 0:  # largest remainders first; then whoever still fits (unequal rank counts)
        fits = [gid for gid in order if ranks[gid] <= left]
        if not fits:
            break
        for gid in fits:
            if ranks[gid] <= left:
                out[gid] += ranks[gid]
                left -= ranks[gid]
    return out


# A group "sets the pace" when every step waits at least this long for it, and that wait is
# at least this part of the others' cycle: below both, the hint would be noise (a box's
# cycle moves by tens of milliseconds from step to step).
PACE_GAP_S = 0.2
PACE_GAP_PART = 0.2


@dataclass(frozen=True)
class PaceGap:
    """A group that every boundary waits for: its cycle takes ``cycle_s`` at its share of
    ``samples`` against the others' ``others_s``. ``fix`` says what would help: ``"speed"``
    (equal shares: the speed split would size its batch to its speed, ``samples_by_speed``)
    or ``"segment"`` (it already takes its least share, one sample per rank: ``segment`` is
    the ``segment_samples`` at which the others' shares would fill its cycle, so that they
    do more samples while it does its least)."""

    group: int
    samples: int
    cycle_s: float
    others_s: float
    fix: str
    segment: int = 0
    samples_by_speed: int = 0


def pace_gap(segment: int, groups: dict[int, tuple], shares: dict[int, int],
             mode: str = "speed") -> PaceGap | None:
    """The group that every boundary waits for, where a setting would help, or None.
    ``groups`` as for :func:`split_samples` (id -> ranks, rate, fixed_s), ``shares`` its
    result in ``mode``. A group's cycle is ``fixed_s + samples / rate``. With equal shares a
    slow box's gap is the split's to close (``shares: speed``); with the speed split the
    cycles are equal wherever it can make them so, and a gap is left only where a group's
    least share is already too much. The split cannot help then; the user can: more samples
    per segment (the others do more in the same cycle), fewer ranks in that group, or no
    such group."""
    if len(groups) < 2 or any(g[1] is None for g in groups.values()):
        return None
    ranks, rate, fixed = _parts(groups)
    cycle = {gid: fixed[gid] + shares[gid] / rate[gid] for gid in groups}
    slow = max(cycle, key=lambda gid: cycle[gid])
    rest = max(c for gid, c in cycle.items() if gid != slow)
    if cycle[slow] - rest < max(PACE_GAP_S, PACE_GAP_PART * rest):
        return None
    found = {"group": slow, "samples": shares[slow], "cycle_s": cycle[slow], "others_s": rest}
    if mode == "equal":
        by_speed = split_samples(segment, groups, "speed")
        return (PaceGap(**found, fix="speed", samples_by_speed=by_speed[slow])
                if by_speed[slow] < shares[slow] else None)
    if shares[slow] > ranks[slow]:
        return None
    fill = shares[slow] + sum(max(ranks[g], rate[g] * (cycle[slow] - fixed[g]))
                              for g in groups if g != slow)
    return PaceGap(**found, fix="segment",
                   segment=max(segment + 1, math.ceil(fill / len(groups))))
