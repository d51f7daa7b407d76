"""The replica groups' sample books: which sample indices are out, used, or due again.

Samples are addressed by index (``(start, count)`` ranges). Fresh ones come from a cursor;
those a group no longer holds (it died, healed, or its step failed) go to a queue that the
next assignments drain first. A quorum's contributions are *tentative* until a later quorum
moves past their step: only then did they enter a committed average, and they count as
consumed. A checkpoint keeps a copy of the books (taken when it is written, in force once
it is in storage); a restore from it hands out again everything not used at its step.
So no sample is skipped or used twice, whatever leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_mesh.replicas.coordinator import Range


@dataclass
class Books:
    cursor: int = 0
    queue: list[Range] = field(default_factory=list)
    tentative: list[Range] = field(default_factory=list)  # the last quorum's contributions
    consumed: int = 0  # samples whose contribution entered a committed average
    saved: dict[str, Any] = field(default_factory=dict)  # at the last checkpoint
    pending: dict[int, dict[str, Any]] = field(default_factory=dict)  # still uploading

    def requeue(self, ranges: list[Range]) -> None:
        self.queue.extend(r for r in ranges if r[1] > 0)

    def take(self, n: int) -> list[Range]:
        """``n`` samples: the queue's first, then fresh ones."""
        out: list[Range] = []
        while n > 0 and self.queue:
            start, count = self.queue.pop(0)
            use = min(count, n)
            out.append((start, use))
            if count > use:
                self.queue.insert(0, (start + use, count - use))
            n -= use
        if n > 0:
            out.append((self.cursor, n))
            self.cursor += n
        return out

    def settle(self, moved_on: bool, contributions: list[Range],
               released: list[Range]) -> None:
        """A quorum formed: the last one's contributions count if it ``moved_on`` past
        their step, otherwise those not offered again (``contributions``) are due again;
        this quorum's ``contributions`` wait for the next; ``released`` (assigned, not
        contributed) are due again."""
        if moved_on:
            self.consumed += sum(n for _, n in self.tentative)
        elif self.tentative:
            still = set(contributions)
            self.requeue([r for r in self.tentative if r not in still])
        self.tentative = list(contributions)
        self.requeue(released)

    def snapshot(self, step_committed: bool, open_ranges: list[Range]) -> dict[str, Any]:
        """The books of a checkpoint: what it used (with the last contributions if that
        step committed) and what a restore must hand out again (the queue and
        ``open_ranges``)."""
        used = self.consumed + (sum(n for _, n in self.tentative) if step_committed else 0)
        return {"cursor": self.cursor, "queue": self.queue + open_ranges, "consumed": used}

    def save(self, step_committed: bool, open_ranges: list[Range]) -> None:
        """A checkpoint written now: its books become the ones a restore goes back to."""
        self.saved = self.snapshot(step_committed, open_ranges)

    def hold(self, step: int, step_committed: bool, open_ranges: list[Range]) -> None:
        """Step ``step``'s checkpoint is written but still uploading: its books wait in
        ``pending`` until :meth:`keep` (uploaded) or :meth:`drop` (failed)."""
        self.pending[step] = self.snapshot(step_committed, open_ranges)

    def keep(self, step: int) -> bool:
        """Step ``step``'s upload is complete: its held books become the saved ones (and
        any held for older steps are dropped). False when none were held for it."""
        held = self.pending.pop(step, None)
        self.pending = {s: b for s, b in self.pending.items() if s > step}
        if held is None:
            return False
        self.saved = held
        return True

    def drop(self, step: int) -> None:
        self.pending.pop(step, None)

    def load(self) -> None:
        """Back to the last checkpoint's books."""
        self.cursor, self.queue = self.saved["cursor"], list(self.saved["queue"])
        self.consumed = self.saved["consumed"]
        self.tentative = []

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "queue": list(self.queue),
                "tentative": list(self.tentative), "consumed": self.consumed}
