"""Between a replica group and the run's coordinator: what a group calls
(:class:`Coordinator`) and what the quorum tells it at a boundary (:class:`Decision`, plain
data that travels through Ray to every rank of the group)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ray_mesh.errors import GroupDropped

Range = tuple[int, int]  # (first sample index, count)
QUORUM_POLL_S = 5.0  # one call's wait for the quorum (a collective bound is >= 15 s)


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
    # indices of every member holding the newest step, the donor first: the healers take
    # the state from all of them at once (link.send_state_); [donor] when restoring
    donors: list[int] = field(default_factory=list)
    # the rank count every member has (the smallest group's): between groups of different
    # layouts, ranks 0..lanes-1 of each group each carry a slice of the full tensors
    # (replicas.group, ``exchange="full"``); 1: the leaders carry all of it
    lanes: int = 1

    @property
    def heal(self) -> bool:
        return self.index in self.healers

    @property
    def moves_state(self) -> bool:
        """This member sends (part of) the newest state or heals from it (the others hold
        it)."""
        return self.donor is not None and (self.heal or self.index in self.sources)

    @property
    def sources(self) -> list[int]:
        """The members that send a heal's state: every holder of the newest step."""
        return self.donors or ([] if self.donor is None else [self.donor])

    @property
    def contributes(self) -> bool:
        return self.index in self.contributors


class Coordinator(Protocol):
    """What a group needs from the run's coordinator (a Ray actor in ray_mesh.raytrain)."""

    def register(self, gid: int, incarnation: str, ranks: int, layout: str = "") -> None: ...
    def beat(self, gid: int, incarnation: str, rank: int) -> int | None: ...
    def arrive(self, gid: int, incarnation: str, step: int, holding: list[Range],
               fresh_link: bool, busy_s: float | None = None, fixed_s: float | None = None,
               wait_s: float | None = None) -> Decision | None: ...  # None: wait on
    def await_decision(self, gid: int, incarnation: str, wait_s: float
                       ) -> Decision | None: ...
    def checkpoint_started(self, step: int) -> None: ...  # written, uploading (fallback)
    def checkpointed(self, step: int, path: str) -> None: ...  # in storage, complete
    def checkpoint_failed(self, gid: int, step: int, error: str) -> None: ...
    def store_address(self) -> tuple[str, int, str]: ...  # host, port, key (link_store)


def meet_quorum(client: Coordinator, leader: bool, share: Callable[[Any], Any], gid: int,
                incarnation: str, step: int, holding: list[Range], fresh: bool,
                busy_s: float | None, fixed_s: float | None) -> Decision:
    """A group at a boundary: its leader meets the quorum in calls of at most
    :data:`QUORUM_POLL_S` and ``share``s each answer with the group's other ranks (a
    broadcast from rank 0). Their wait is then one short collective after another, never
    one as long as the slowest group takes to arrive: a long one would end at the hang
    watch's bound (``hang_timeout_s``) and fail the group on a merely busy machine."""
    answer: Any = None
    first = True
    while answer is None:
        if leader:
            try:
                answer = (client.arrive(gid, incarnation, step, holding, fresh, busy_s,
                                        fixed_s, wait_s=QUORUM_POLL_S) if first
                          else client.await_decision(gid, incarnation, QUORUM_POLL_S))
            except (GroupDropped, TimeoutError) as exc:
                answer = exc
            except Exception as exc:  # noqa: BLE001 - every rank of the group raises it
                answer = RuntimeError(f"replica group {gid}: the coordinator did not answer "
                                      f"at step {step}: {exc!r}")
        answer, first = share(answer), False
    if isinstance(answer, BaseException):
        raise answer
    return answer
