"""Between a replica group and the run's coordinator: what a group calls
(:class:`Coordinator`) and what the quorum tells it at a boundary (:class:`Decision`, plain
data that travels through Ray to every rank of the group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Range = tuple[int, int]  # (first sample index, count)


@dataclass
class Decision:
    """What one quorum tells one member group (plain data: it travels through Ray)."""

    epoch: int                  # bumps whenever the member list changes: a new process group
    step: int                   # the newest step any member holds (after healing: everyone's)
    members: list[int]          # group ids, ascending; a group's index here is its cross rank
    index: int                  # this group's position in ``members``
    donor: int | None           # index of the member whose state the healers receive
    healers: list[int]          # indices of members that receive the donor's state
    contributors: list[int]     # indices of members whose contribution enters the average
    ranges: list[Range]         # this group's samples for its next segment
    restore: tuple[int, str] | None = None  # (step, path): the donor loads this first
    done: bool = False          # the run has finished: return
    waited_s: float = 0.0       # how long this group waited at the quorum for the others

    @property
    def heal(self) -> bool:
        return self.index in self.healers

    @property
    def contributes(self) -> bool:
        return self.index in self.contributors


class Coordinator(Protocol):
    """What a group needs from the run's coordinator (a Ray actor in ray_mesh.raytrain)."""

    def register(self, gid: int, incarnation: str, ranks: int, layout: str = "") -> None: ...
    def beat(self, gid: int, incarnation: str, rank: int) -> int | None: ...
    def arrive(self, gid: int, incarnation: str, step: int, holding: list[Range],
               fresh_link: bool, busy_s: float | None = None,
               fixed_s: float | None = None) -> Decision: ...
    def checkpointed(self, step: int, path: str) -> None: ...
    def store_address(self) -> tuple[str, int, str]: ...  # host, port, key (link_store)


__all__ = ["Coordinator", "Decision", "Range"]
