"""When a replica group counts as gone: its ranks' heartbeats and a bound that follows them.

A box starved of CPU for a few seconds (a busy head node, a CPU quota, a hog beside the run)
is slow, not dead: dropping it costs the group a restart and the others a new link. So a
group's bound is ``dead_after_s`` or :data:`JITTER_MARGIN` times the longest gap between its
recent beats, whichever is larger, and at most :data:`MAX_STRETCH` times ``dead_after_s``: a
group that really died is still dropped in bounded time. An arrival at the quorum counts as
a beat of every rank of the group (its ranks just finished a step together to get there).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

JITTER_MARGIN = 2.0  # a group's bound stays this many times above its longest recent gap
MAX_STRETCH = 3.0  # ... and at most this many times dead_after_s
GAPS_KEPT = 32  # recent gaps between a group's beats (all ranks) that set its bound


@dataclass
class Beats:
    """The heartbeats of one attempt of a group: the last beat of each rank, recent gaps."""

    ranks: int
    last: dict[int, float] = field(default_factory=dict)
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=GAPS_KEPT))

    @classmethod
    def starting(cls, ranks: int, now: float) -> Beats:
        """A group that just registered: every rank counts as having beaten now."""
        return cls(ranks, {rank: now for rank in range(ranks)})

    def beat(self, rank: int, now: float) -> None:
        if rank in self.last:
            self.gaps.append(now - self.last[rank])
        self.last[rank] = now

    def arrived(self, now: float) -> None:
        """The group reached a boundary: all of its ranks were alive a moment ago."""
        for rank in self.last:
            self.last[rank] = max(self.last[rank], now)

    def bound(self, dead_after_s: float) -> float:
        """Seconds without a beat after which the group counts as gone."""
        jitter = JITTER_MARGIN * max(self.gaps, default=0.0)
        return min(max(dead_after_s, jitter), MAX_STRETCH * dead_after_s)

    def alive(self, now: float, dead_after_s: float) -> bool:
        bound = self.bound(dead_after_s)
        return len(self.last) == self.ranks and all(now - t <= bound
                                                    for t in self.last.values())
