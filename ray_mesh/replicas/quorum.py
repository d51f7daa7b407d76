"""Who trains the next step, and on which samples: the replica groups' membership and data.

One :class:`Quorum` per run (in the Ray glue it lives in a coordinator actor on the driver's
node). Every replica group (one ``dp_replicate`` index: its own inner mesh, its own Ray
Train run) meets it at each *boundary*, just before the collective that crosses groups:
the gradient all-reduce of a synchronous HSDP step, or the pseudo-gradient average that
closes a DiLoCo round. There the quorum

* decides the members: every group that is alive (all of its ranks sent a heartbeat within
  ``dead_after_s``, longer for a jittery box: :mod:`.liveness`) and has arrived. A group
  that stops beating is dropped (its ranks get "dropped" on their next call and fail, so
  that Ray Train replaces that group alone);
* picks the donors (every group holding the newest step, the lowest first) and the groups
  to heal from them over the network, each donor sending a part: a group that joins or
  returns, or one left behind by a failed step;
* hands each member the samples of its next segment (``segment_samples`` sample indices per
  group per boundary on average, as ``(start, length)`` ranges; by measured speed with
  ``shares="speed"``, :mod:`.shares`), and keeps the books so that no sample is skipped or
  repeated: the samples of a group that died before its contribution counted go back to a
  queue that the next assignments drain first.

Why a step boundary: a group's contribution (gradients, or a round's inner work) counts
once every member agrees to average it. A failed collective leaves each survivor's
contribution intact (it arrives again with the same samples); the dead group's are handed
out again. Members left behind by a peer that died half-way through the collective heal
from the ones ahead, and their samples count as used (they were in the average).

Ray-free and clock-injectable: the unit tests drive it with threads and a fake clock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_mesh.errors import GroupDropped
from ray_mesh.replicas.books import Books
from ray_mesh.replicas.coordinator import Decision, Range
from ray_mesh.replicas.liveness import Beats
from ray_mesh.replicas.shares import Pace, check_mode, pace_gap, split_samples

SWEEP_S = 0.1  # seconds between sweeps for silent groups (reads all): scale_quorum.py


@dataclass
class _Group:
    incarnation: str
    beats: Beats
    ready: bool = False           # arrived at least once: counts for the quorum from then on
    arrival: dict[str, Any] | None = None
    assigned: list[Range] = field(default_factory=list)
    decision: Decision | None = None
    pace: Pace = field(default_factory=Pace)  # compute rate, boundary cost (shares="speed")
    share: int = 0                # samples of its last assignment


class Quorum:
    """The membership and data books of one run's replica groups (thread-safe).

    ``segment_samples``: samples one group processes between two boundaries (its batch for
    one sync step, or ``every`` inner steps' worth for DiLoCo). ``total_steps``: the run
    ends when a quorum finds this step reached. ``arrive_timeout_s`` bounds how long the
    members wait for a live group that does not arrive; it is then dropped and named.
    ``shares``: ``"equal"`` (every member gets ``segment_samples``) or ``"speed"`` (split
    by measured speed, in multiples of each group's rank count; see the module docstring).
    """

    def __init__(self, *, segment_samples: int, total_steps: int, dead_after_s: float = 5.0,
                 arrive_timeout_s: float = 300.0, expected_groups: int = 1,
                 start_timeout_s: float = 120.0, shares: str = "equal",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if segment_samples < 1:
            raise ValueError(f"segment_samples={segment_samples}: a group needs at least one "
                             "sample per segment")
        check_mode(shares)
        self.segment_samples, self.shares = segment_samples, shares
        self.total_steps, self.dead_after_s = total_steps, dead_after_s
        self.arrive_timeout_s, self.clock = arrive_timeout_s, clock
        self.expected_groups, self.start_timeout_s = expected_groups, start_timeout_s
        self._cv = threading.Condition()
        self._groups: dict[int, _Group] = {}
        self.books = Books()  # the sample books (:mod:`.books`)
        self._last: tuple[int, frozenset[int]] | None = None  # (step, members) last formed
        self._epoch = self._broken = 0  # the newest, and the newest that lost a member
        self._formed = self._max_step_seen = 0
        self._checkpoint: tuple[int, str] | None = None
        self._finished = self._all_gone = False
        self._left: set[int] = set()  # dropped while members: "joined" when back
        self._swept = -math.inf  # when _drop_dead last read every group
        self._changed = False  # a member left, or a group restarted, since the last quorum
        self._fail_ranks: dict[int, set[int]] = {}  # ranks that reported a group's last error
        self.events: list[dict[str, Any]] = []
        self._paced: set[int] = set()  # groups already named as setting the pace
        # Kept as groups change, so that an arrival costs O(1), not a pass over every group
        # (512 groups: 512 arrivals per boundary, each woken waiter trying to form):
        self._ready_n = 0  # groups with ready set
        self._arrived_n = 0  # groups with an arrival (every one of them is ready)
        self._first_since = math.inf  # the earliest arrival's "since" (inf: none)

    # ------------------------------------------------------------------ membership
    def register(self, gid: int, incarnation: str, ranks: int) -> None:
        """A group's incarnation starts (every Ray Train attempt of that group is a new one).
        What an older incarnation held goes back to the queue."""
        with self._cv:
            old = self._groups.get(gid)
            if old is not None and old.incarnation != incarnation:
                self.books.requeue(old.assigned)
                self._event("replaced", gid, "a new attempt of the group started")
                self._changed = True
            if old is not None:
                self._forget_counts(old)
            self._groups[gid] = _Group(incarnation, Beats.starting(ranks, self.clock()))
            self._cv.notify_all()

    def beat(self, gid: int, incarnation: str, rank: int) -> int | None:
        """A heartbeat from one rank. None when that incarnation is no longer a member;
        otherwise the newest epoch that lost a member after it formed: a group waiting on
        that epoch's link abandons the wait (:mod:`.link`) rather than wait for a peer
        that will not come."""
        with self._cv:
            g = self._groups.get(gid)
            if g is None or g.incarnation != incarnation:
                return None
            g.beats.beat(rank, self.clock())
            self._sweep()  # the beats of the groups left drive it while none arrives
            return self._broken

    def _sweep(self) -> None:  # run at every beat, arrival and poll: once per SWEEP_S
        if self.clock() - self._swept >= SWEEP_S:
            self._drop_dead()

    def _drop_dead(self) -> None:
        if self._finished:  # the groups stop beating as they end: not a departure
            return
        now = self._swept = self.clock()
        for gid, g in list(self._groups.items()):
            if not g.beats.alive(now, self.dead_after_s):
                self._drop(gid, "stopped beating (a worker or its node is gone)")

    def _drop(self, gid: int, why: str) -> None:
        g = self._groups.pop(gid)
        self._forget_counts(g)
        self.books.requeue(g.assigned)
        if self._last is not None and gid in self._last[1]:
            self._broken = self._epoch  # its members may be waiting for it on the link
        if g.ready and not self._ready_n:
            self._all_gone = True  # the next quorum is a restart: it waits for everyone
        if g.ready:
            self._event("left", gid, why)
            self._left.add(gid)
            self._changed = True
        self._cv.notify_all()

    # ------------------------------------------------------------------ the boundary
    def arrive(self, gid: int, incarnation: str, step: int, holding: list[Range],
               fresh_link: bool = False, timeout_s: float | None = None,
               busy_s: float | None = None, fixed_s: float | None = None,
               wait_s: float | None = None) -> Decision | None:
        """Group ``gid`` reaches a boundary holding state at ``step`` and a contribution
        computed on ``holding`` (its assigned samples; may be empty). Blocks until a quorum
        forms (``timeout_s`` at most) and returns this group's part of it, or None after
        ``wait_s`` (:meth:`await_decision` waits on). ``fresh_link``: its last collective
        failed: new process groups (a new epoch). ``busy_s``/``fixed_s``: its compute and
        own boundary seconds (:class:`.shares.Pace`)."""
        holding = [tuple(r) for r in holding]
        with self._cv:
            g = self._member(gid, incarnation)
            if self._finished:
                return self._done_decision()
            g.pace.update(sum(n for _, n in holding), busy_s, fixed_s)
            g.beats.arrived(self.clock())
            self._ready_n += not g.ready
            self._arrived_n += g.arrival is None
            g.ready = True
            g.decision = None
            bound = self.arrive_timeout_s + self.dead_after_s + 30 if timeout_s is None \
                else timeout_s
            g.arrival = {"step": step, "holding": holding, "fresh_link": fresh_link,
                         "since": self.clock(), "deadline": self.clock() + bound}
            self._first_since = min(self._first_since, g.arrival["since"])
            self._cv.notify_all()
            return self._await(g, gid, incarnation, wait_s)

    def await_decision(self, gid: int, incarnation: str, wait_s: float | None = None
                       ) -> Decision | None:
        """After :meth:`arrive` returned None: wait on, at most ``wait_s``. The group's
        other ranks wait in a collective meanwhile: short waits never look like a hang."""
        with self._cv:
            g = self._member(gid, incarnation)
            return self._done_decision() if self._finished else self._await(
                g, gid, incarnation, wait_s)

    def _await(self, g: _Group, gid: int, incarnation: str, wait_s: float | None
               ) -> Decision | None:
        until = None if wait_s is None else self.clock() + wait_s
        while g.decision is None:
            self._member(gid, incarnation)
            if self._finished:
                return self._done_decision()
            self._try_form()
            if g.decision is not None:
                break
            if g.arrival is not None and self.clock() > g.arrival["deadline"]:
                raise TimeoutError(f"replica group {gid}: no quorum formed within "
                                   f"{g.arrival['deadline'] - g.arrival['since']:g} s at "
                                   f"step {g.arrival['step']}")
            if until is not None and self.clock() >= until:
                return None
            self._cv.wait(timeout=0.2)
        return g.decision

    def _member(self, gid: int, incarnation: str) -> _Group:
        g = self._groups.get(gid)
        if g is None or g.incarnation != incarnation:
            raise GroupDropped(f"replica group {gid} (attempt {incarnation}) is no longer a "
                               "member of the run: Ray Train starts it again")
        return g

    def _forget_counts(self, g: _Group) -> None:
        """``g`` leaves ``_groups`` (dropped, or replaced by a new incarnation)."""
        self._ready_n -= g.ready
        if g.arrival is not None:
            self._arrived_n -= 1
            self._first_since = min((x.arrival["since"] for x in self._groups.values()
                                     if x is not g and x.arrival is not None), default=math.inf)

    def _try_form(self) -> None:
        """Form a quorum when every ready group has arrived, or the late ones time out.
        O(1) until it forms (the counters), one pass over the groups when it does."""
        self._sweep()
        if not self._arrived_n:
            return
        since_first = self.clock() - self._first_since
        if ((self._formed == 0 or self._all_gone) and self._arrived_n < self.expected_groups
                and since_first < self.start_timeout_s):  # a (re)start waits for all
            return
        if self._arrived_n < self._ready_n and since_first < self.arrive_timeout_s:
            return  # a ready group has not arrived yet
        self._all_gone = False
        for gid in [gid for gid, g in self._groups.items() if g.ready and g.arrival is None]:
            self._drop(gid, f"did not reach the boundary within {self.arrive_timeout_s:g} s")
        self._form({gid: g for gid, g in self._groups.items() if g.arrival is not None})

    def _form(self, arrived: dict[int, _Group]) -> None:
        members = sorted(arrived)
        steps = {gid: arrived[gid].arrival["step"] for gid in members}
        top = max(steps.values())
        restore = None
        if self._checkpoint is not None and self._checkpoint[0] > top:
            restore, top = self._checkpoint, self._checkpoint[0]
            self._event("restore", members[0], f"every group that held the run's state is "
                        f"gone (the last boundary was at step {self._max_step_seen}): "
                        f"restoring step {top} from {restore[1]}", step=top)
        if top < self._max_step_seen and restore is None:
            self._event("lost", members[0], f"every group that held step "
                        f"{self._max_step_seen} is gone and no checkpoint is newer: going on "
                        f"from step {top}", step=top)
        if restore:  # the donor loads the checkpoint; every other member heals from it
            donor_gid = members[0]
            healers = members[1:]
            holders = [donor_gid]
            contributors: list[int] = []
        else:  # every holder of the newest step sends a part of it (link.send_state_)
            holders = [g for g in members if steps[g] == top]
            donor_gid = holders[0]
            healers = [g for g in members if steps[g] < top]
            contributors = [g for g in members
                            if g not in healers and arrived[g].arrival["holding"]]
        if restore:
            self.books.load()
            for g in self._groups.values():
                g.assigned = []
        else:
            self._settle_books(arrived, members, contributors, top)
        membership = frozenset(members)
        fresh = any(arrived[g].arrival["fresh_link"] for g in members)
        if self._last is None or self._last[1] != membership or fresh or self._changed:
            self._epoch += 1
            self._membership_events(membership, top)
        self._changed = False
        self._last = (top, membership)
        self._formed += 1
        self._max_step_seen = max(self._max_step_seen, top)
        source = (f"group {donor_gid}" if len(holders) == 1 else
                  "groups " + ", ".join(str(g) for g in holders))
        for gid in healers:
            self._event("healed", gid, f"state of step {top} from {source}", step=top)
        finished = top >= self.total_steps
        idx = {gid: i for i, gid in enumerate(members)}
        now, heal_idx, contrib_idx = self.clock(), [idx[h] for h in healers], [
            idx[c] for c in contributors]  # one list for every decision: O(groups), not squared
        donor_idx = [idx[g] for g in holders] if (healers or restore) else []
        paces = {gid: (arrived[gid].beats.ranks, arrived[gid].pace.rate,
                       arrived[gid].pace.fixed_s) for gid in members}
        shares = split_samples(self.segment_samples, paces, self.shares)
        if all(arrived[g].pace.settled for g in members):
            self._tell_pace(paces, shares, top)
        lanes = min(arrived[gid].beats.ranks for gid in members)
        for gid in members:
            g = arrived[gid]
            g.share = 0 if finished else shares[gid]
            g.assigned = self.books.take(g.share)
            g.decision = Decision(
                epoch=self._epoch, step=top, members=members, index=idx[gid],
                donor=idx[donor_gid] if (healers or restore) else None,
                healers=heal_idx, contributors=contrib_idx,
                ranges=list(g.assigned), restore=restore if gid == donor_gid else None,
                done=finished, waited_s=max(0.0, now - g.arrival["since"]),
                donors=donor_idx, lanes=lanes)
            g.arrival = None
        self._arrived_n, self._first_since = 0, math.inf  # every arrival was a member
        if finished:
            self._finished = True
        self._cv.notify_all()

    def _settle_books(self, arrived: dict[int, _Group], members: list[int],
                      contributors: list[int], top: int) -> None:
        """The books after a quorum (:meth:`.books.Books.settle`); members' assignments
        are released but for what they contributed."""
        contributions = [r for gid in contributors for r in arrived[gid].arrival["holding"]]
        released = []
        for gid in members:
            g = arrived[gid]
            held = set(g.arrival["holding"]) if gid in contributors else set()
            released += [r for r in g.assigned if r not in held]
            g.assigned = []
        self.books.settle(self._last is not None and top > self._last[0], contributions,
                          released)

    def _tell_pace(self, paces: dict[int, tuple], shares: dict[int, int], step: int) -> None:
        """Name, once a run, a group that every boundary waits for (:func:`~.shares.pace_gap`),
        with what would help: the speed split, or (when it cannot) the user's settings."""
        gap = pace_gap(self.segment_samples, paces, shares, self.shares)
        if gap is None or gap.group in self._paced:
            return
        self._paced.add(gap.group)
        n = f"{gap.samples} sample{'s' if gap.samples != 1 else ''}"
        took = (f"its step takes {gap.cycle_s:.2f} s, the others' {gap.others_s:.2f} s, and "
                "every step waits for it")
        if gap.fix == "speed":
            said = (f"at equal shares ({n} each) {took}. shares: speed would size each "
                    f"group's batch to its speed (this group's to {gap.samples_by_speed})")
        else:
            said = (f"at its least share ({n}, one per rank) {took}. Give the others more "
                    f"to do (segment_samples: {gap.segment}, now {self.segment_samples}), "
                    "give it fewer workers (groups: auto: its box's ray start --num-cpus or "
                    "--num-gpus) or leave it out")
        self._event("paces", gap.group, said, step=step)

    def _membership_events(self, members: frozenset[int], step: int) -> None:
        before = self._last[1] if self._last is not None else frozenset()
        back = members & self._left
        self._left -= members
        for gid in sorted((members - before) | back):
            self._event("joined", gid, f"{len(members)} group(s) now", step=step)

    def _done_decision(self) -> Decision:
        return Decision(epoch=self._epoch, step=self._max_step_seen, members=[], index=-1,
                        donor=None, healers=[], contributors=[], ranges=[], done=True)

    # ------------------------------------------------------------------ the rest
    def failed(self, gid: int, error: str, rank: int = 0, incarnation: str | None = None
               ) -> None:
        """Rank ``rank`` of group ``gid`` raised in its train function: one event per
        attempt (a second report from a rank that already reported, with no rejoin between,
        is the next attempt). Given the attempt's ``incarnation``, it leaves at once."""
        with self._cv:
            seen = self._fail_ranks.get(gid)
            last = next((e for e in reversed(self.events) if e["group"] == gid
                         and e["kind"] in ("failed", "joined", "healed")), None)
            if (seen is not None and rank not in seen and last is not None
                    and last["kind"] == "failed" and last["detail"] == error):
                seen.add(rank)
            else:
                self._fail_ranks[gid] = {rank}
                self._event("failed", gid, error)
            g = self._groups.get(gid)
            if incarnation is not None and g is not None and g.incarnation == incarnation:
                self._drop(gid, f"its rank {rank} failed (the error above)")

    def attempt_ended(self, gid: int, why: str) -> None:
        """Ray Train saw group ``gid``'s attempt end (a worker raised, or died: its health
        check failed): it leaves now, not ``dead_after_s`` after its last heartbeat. Ray
        Train starts the next attempt after this call (it registers anew)."""
        with self._cv:
            if gid in self._groups and not self._finished:
                self._drop(gid, why)

    def checkpoint_started(self, step: int) -> None:
        """``step``'s checkpoint is written and uploading: its sample books are taken now
        (they are those of this step) and kept with it once :meth:`checkpointed` says it
        is in storage."""
        with self._cv:
            self.books.hold(step, *self._books_at(step))

    def checkpointed(self, step: int, path: str) -> None:
        """A complete checkpoint of ``step`` is at ``path`` (in storage, all of it): the
        fallback when every group that held a newer step is gone. Its sample books are kept
        with it: a restore hands out again everything not yet used at that step."""
        with self._cv:
            if self._checkpoint is not None and (step < self._checkpoint[0] or (
                    step == self._checkpoint[0] and step not in self.books.pending)):
                self.books.drop(step)  # older, or the same step recorded already
                return
            self._checkpoint = (step, path)
            if not self.books.keep(step):  # not announced: its books are those of now
                self.books.save(*self._books_at(step))

    def checkpoint_failed(self, gid: int, step: int, error: str) -> None:
        """``step``'s checkpoint did not reach storage: the fallback stays the previous."""
        with self._cv:
            self.books.drop(step)
            self._event("unsaved", gid, error, step=step)

    def _books_at(self, step: int) -> tuple[bool, list[Range]]:
        open_ranges = [r for g in self._groups.values() for r in g.assigned]
        return self._last is not None and self._last[0] == step - 1, open_ranges

    def data_state(self) -> dict[str, Any]:
        """The sample books, to save with a checkpoint (and to check in tests)."""
        with self._cv:
            return self.books.state()

    def status(self) -> dict[str, Any]:
        """Plain data for the console, ``ray-mesh status`` and the metrics."""
        with self._cv:
            self._drop_dead()
            return {"live": sorted(gid for gid, g in self._groups.items() if g.ready),
                    "registered": sorted(self._groups), "epoch": self._epoch,
                    "shares": {gid: {"ranks": g.beats.ranks, "samples": g.share,
                                     "samples_per_s": g.pace.speed(g.share)}
                               for gid, g in sorted(self._groups.items()) if g.ready},
                    "step": self._max_step_seen, "quorums": self._formed,
                    "checkpoint": list(self._checkpoint) if self._checkpoint else None,
                    "finished": self._finished, "events": list(self.events),
                    **{k: v for k, v in self.data_state().items() if k != "tentative"}}

    def _event(self, kind: str, gid: int, detail: str, step: int | None = None) -> None:
        self.events.append({"kind": kind, "group": gid, "detail": detail,
                            "step": self._max_step_seen if step is None else step,
                            "t": time.time()})
