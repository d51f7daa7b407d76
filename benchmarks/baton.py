"""Turn-taking between launchers that are alive at the same time (paired step timing).

Timing one launcher's job, then the other's, on a 2-core machine compares two stretches of
time: another process, a page-cache flush or thermal drift makes one stretch 2x slower than
the next (``RESULTS.md`` has such runs). Here every contender is started first, warms up,
then they take turns: one timing window each, in a rotating order, while the others wait
idle in a barrier. Drift then lands on all contenders alike, and window k of one contender
is compared with window k of another (a paired ratio).

Only rank 0 of each contender touches the files; its other ranks wait in ``dist.barrier``.
A shared directory holds ``<name>.ready`` per contender and ``baton``: the index of the
schedule entry whose turn it is. Every wait is bounded.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

POLL_S = 0.002


class BatonTimeout(RuntimeError):
    """A contender waited longer than its bound for the others."""


def rotating_schedule(contenders: list[str], rounds: int) -> list[str]:
    """Every contender once per round; round r starts r places further on.

    Each contender then takes every position (first, middle, last) equally often, so
    "the window right after a contender switch is slower" hits all of them alike.
    """
    n = len(contenders)
    return [contenders[(r + i) % n] for r in range(rounds) for i in range(n)]


class Baton:
    def __init__(self, directory: str, name: str, contenders: list[str], schedule: list[str],
                 timeout_s: float = 900.0) -> None:
        if name not in contenders:
            raise ValueError(f"{name!r} is not one of the contenders {contenders}")
        self.dir = Path(directory)
        self.name = name
        self.contenders = contenders
        self.schedule = schedule
        self.timeout_s = timeout_s

    @property
    def turns(self) -> list[int]:
        return [i for i, who in enumerate(self.schedule) if who == self.name]

    def _wait(self, done, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise BatonTimeout(
                    f"contender {self.name!r} waited {self.timeout_s:.0f} s for {what} in "
                    f"{self.dir}: another contender failed or is stuck; see its log")
            time.sleep(POLL_S)

    def ready(self) -> None:
        """Say this contender is warm, then wait until every contender is."""
        (self.dir / f"{self.name}.ready").write_text(str(os.getpid()))
        self._wait(lambda: all((self.dir / f"{c}.ready").exists() for c in self.contenders),
                   "every contender to warm up")

    def _current(self) -> int:
        try:
            return int((self.dir / "baton").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def wait_turn(self, index: int) -> None:
        self._wait(lambda: self._current() == index, f"schedule entry {index}")

    def pass_on(self, index: int) -> None:
        tmp = self.dir / f"baton.{self.name}.tmp"
        tmp.write_text(str(index + 1))
        os.replace(tmp, self.dir / "baton")
