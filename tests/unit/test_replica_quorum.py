"""The replica groups' quorum (ray_mesh.replicas.quorum): membership, healing, and the sample
books, driven by threads and a fake clock (the real thing runs in a Ray actor; the Ray
tests drive it with real groups)."""

from __future__ import annotations

import math
import threading

import pytest

from ray_mesh.replicas.quorum import GroupDropped, Quorum

SEG = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def counts_checked(monkeypatch):
    """Every formation attempt of every test first checks the quorum's counters (kept as
    groups change, so that an arrival is O(1)) against a pass over its groups."""
    real = Quorum._try_form

    def checked(self: Quorum) -> None:
        groups = list(self._groups.values())
        arrived = [g for g in groups if g.arrival is not None]
        assert all(g.ready for g in arrived)
        assert self._ready_n == sum(g.ready for g in groups), "ready count"
        assert self._arrived_n == len(arrived), "arrival count"
        assert self._first_since == min((g.arrival["since"] for g in arrived), default=math.inf)
        real(self)

    monkeypatch.setattr(Quorum, "_try_form", checked)


def make(groups: int = 3, **kw) -> tuple[Quorum, Clock]:
    clock = Clock()
    q = Quorum(segment_samples=SEG, total_steps=kw.pop("total_steps", 100),
               expected_groups=kw.pop("expected_groups", groups), clock=clock, **kw)
    for g in range(groups):
        q.register(g, f"a{g}", 1)
    return q, clock


def boundary(q: Quorum, arrivals: dict[int, tuple[int, list]], inc: dict[int, str] | None = None,
             fresh: bool = False) -> dict:
    """Every group in ``arrivals`` (gid -> (step, holding)) arrives at once; their decisions."""
    out, errors = {}, []

    def go(gid: int, step: int, holding: list) -> None:
        try:
            out[gid] = q.arrive(gid, (inc or {}).get(gid, f"a{gid}"), step, holding, fresh,
                                timeout_s=10)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(g, s, h)) for g, (s, h) in arrivals.items()]
    for t in threads:  # in order, a moment apart: a newcomer first waits for the others
        t.start()
        t.join(0.05)
    for t in threads:
        t.join(15)
    assert not errors, errors
    return out


def beat_all(q: Quorum, clock: Clock, gids, dt: float = 1.0) -> None:
    clock.now += dt
    for g in gids:
        q.beat(g, f"a{g}", 0)


def ids(ranges) -> list[int]:
    return [i for s, n in ranges for i in range(s, s + n)]


def test_groups_get_disjoint_samples_and_every_step_counts_once():
    q, _ = make()
    d = boundary(q, {g: (0, []) for g in range(3)})
    assert [d[g].index for g in range(3)] == [0, 1, 2]
    assert d[0].donor is None and d[0].contributors == []
    held = {g: d[g].ranges for g in range(3)}
    for step in range(1, 4):
        d = boundary(q, {g: (step - 1 if step == 1 else step - 1, held[g]) for g in range(3)})
        assert d[0].contributors == [0, 1, 2]
        held = {g: d[g].ranges for g in range(3)}
    used = sorted(i for g in range(3) for i in ids(held[g]))
    assert len(set(used)) == len(used) == 3 * SEG


def test_a_group_that_dies_mid_step_hands_its_samples_to_the_next_assignment():
    q, clock = make()
    d = boundary(q, {g: (0, []) for g in range(3)})
    lost = d[1].ranges
    # group 1 dies while computing: 0 and 2 keep beating, 1 does not
    for _ in range(6):  # past dead_after_s (5 s)
        beat_all(q, clock, [0, 2])
    d2 = boundary(q, {0: (0, d[0].ranges), 2: (0, d[2].ranges)})
    assert d2[0].members == [0, 2] and d2[0].epoch == 2
    assert d2[0].ranges == lost  # the dead group's samples go out first
    assert [e["kind"] for e in q.events if e["group"] == 1] == ["joined", "left"]
    # the contributions of 0 and 2 count once the next boundary moves past step 0
    boundary(q, {0: (1, d2[0].ranges), 2: (1, d2[2].ranges)})
    assert q.books.consumed == 2 * SEG  # the first boundary had nothing to count


def test_a_failed_collective_keeps_the_contributions_and_rebuilds_the_link():
    q, _ = make(2)
    d = boundary(q, {0: (0, []), 1: (0, [])})
    held = {g: d[g].ranges for g in range(2)}
    d1 = boundary(q, {g: (0, held[g]) for g in range(2)})
    unused_next = {g: d1[g].ranges for g in range(2)}
    # the all-reduce failed: both come back at step 0 with the same samples, asking anew
    d2 = boundary(q, {g: (0, held[g]) for g in range(2)}, fresh=True)
    assert d2[0].epoch == d1[0].epoch + 1
    assert d2[0].contributors == [0, 1]
    # what the failed boundary handed out for the next step goes out again
    assert sorted(ids(d2[0].ranges) + ids(d2[1].ranges)) == sorted(
        ids(unused_next[0]) + ids(unused_next[1]))


def test_a_returning_group_heals_from_the_lowest_group_at_the_newest_step():
    q, clock = make(3)
    d = boundary(q, {g: (0, []) for g in range(3)})
    assert d[0].donors == [] and not any(d[g].moves_state for g in range(3))  # no heal
    q.register(1, "b1", 1)  # group 1's second attempt
    clock.now += 0.5
    d = boundary(q, {0: (5, []), 1: (0, []), 2: (5, [])}, inc={1: "b1"})
    assert d[1].heal and d[1].donor == 0 and not d[1].contributes
    assert d[0].step == 5
    # both holders of step 5 send a part of it (link.send_state_), the lowest first
    assert all(d[g].donors == [0, 2] and d[g].sources == [0, 2] for g in range(3))
    assert d[0].moves_state and d[1].moves_state and d[2].moves_state
    assert [e["detail"] for e in q.events if e["kind"] == "healed" and e["group"] == 1] == [
        "state of step 5 from groups 0, 2"]
    with pytest.raises(GroupDropped, match="no longer a member"):
        q.arrive(1, "a1", 5, [], False, timeout_s=1)


def test_every_group_gone_restores_the_checkpoint_and_its_sample_books():
    q, clock = make(2)
    d = boundary(q, {0: (0, []), 1: (0, [])})
    held = {g: d[g].ranges for g in range(2)}
    d = boundary(q, {g: (0, held[g]) for g in range(2)})  # step 1 committed by the next
    q.checkpointed(1, "/ckpt/step_1")
    open_at_checkpoint = ids(d[0].ranges) + ids(d[1].ranges)  # step 1's samples, unused
    boundary(q, {g: (1, d[g].ranges) for g in range(2)})  # step 2 committed later
    for g in range(2):
        q.register(g, f"r{g}", 1)  # both groups came back with nothing
    clock.now += 0.5
    d = boundary(q, {0: (0, [])}, inc={0: "r0"})  # the first one back restores
    assert d[0].restore == (1, "/ckpt/step_1") and d[0].step == 1
    assert d[0].donors == [0]  # it loads the checkpoint: the one source of the step
    assert d[0].contributors == [] and not d[0].heal
    assert any(e["kind"] == "restore" for e in q.events)
    # the samples not yet used at step 1 are handed out again, first
    assert ids(d[0].ranges) == open_at_checkpoint[:SEG]
    # the second one back heals from it over the network, not from storage
    d = boundary(q, {1: (0, []), 0: (1, d[0].ranges)}, inc={0: "r0", 1: "r1"})
    assert d[1].heal and d[1].restore is None and d[1].donor == 0
    assert d[1].donors == [0]  # the one that restored holds the step


def test_an_uploading_checkpoint_is_restored_only_once_in_storage_with_its_own_books():
    """The fallback is written at step 1, and its upload ends a step later: until then the
    quorum does not restore it (every group gone: step 0, nothing lost twice), and once
    recorded it restores step 1 with the books of step 1, not of the upload's end. A failed
    upload leaves the previous fallback and is an event the driver prints."""
    q, clock = make(2)
    d = boundary(q, {0: (0, []), 1: (0, [])})
    held = {g: d[g].ranges for g in range(2)}
    d = boundary(q, {g: (0, held[g]) for g in range(2)})  # step 1 committed by the next
    q.checkpoint_started(1)  # written locally: its books are these
    open_at_checkpoint = ids(d[0].ranges) + ids(d[1].ranges)
    assert q.status()["checkpoint"] is None  # not in storage yet: not a fallback
    d = boundary(q, {g: (1, d[g].ranges) for g in range(2)})  # step 2 meanwhile
    q.checkpoint_started(2)
    q.checkpoint_failed(0, 2, "the fallback checkpoint of step 2 is not in s3://b/x: ...")
    assert [(e["kind"], e["step"]) for e in q.events if e["kind"] == "unsaved"] == \
        [("unsaved", 2)]
    q.checkpointed(1, "s3://b/x/checkpoint_00000001_ab")  # the upload of step 1 ended
    assert q.status()["checkpoint"] == [1, "s3://b/x/checkpoint_00000001_ab"]
    for g in range(2):
        q.register(g, f"r{g}", 1)
    clock.now += 0.5
    d = boundary(q, {0: (0, [])}, inc={0: "r0"})
    assert d[0].restore == (1, "s3://b/x/checkpoint_00000001_ab") and d[0].step == 1
    assert ids(d[0].ranges) == open_at_checkpoint[:SEG]  # step 1's books, not step 2's


def test_the_first_boundary_waits_for_every_expected_group():
    q, clock = make(2, start_timeout_s=30)
    box = {}
    t = threading.Thread(target=lambda: box.update(d=q.arrive(0, "a0", 0, [], False, 10)))
    t.start()
    t.join(0.6)
    assert t.is_alive()  # group 1 is expected: no quorum of one yet
    q.beat(1, "a1", 0)
    t2 = threading.Thread(target=lambda: box.update(d1=q.arrive(1, "a1", 0, [], False, 10)))
    t2.start()
    t.join(5)
    t2.join(5)
    assert box["d"].members == [0, 1]


def test_a_live_group_that_never_arrives_is_dropped_after_the_timeout():
    q, clock = make(2, arrive_timeout_s=5, dead_after_s=100)
    boundary(q, {0: (0, []), 1: (0, [])})
    box = {}
    t = threading.Thread(target=lambda: box.update(d=q.arrive(0, "a0", 0, [], False, 10)))
    t.start()
    t.join(0.5)
    assert t.is_alive()
    clock.now += 6
    t.join(5)
    assert box["d"].members == [0]
    assert any(e["kind"] == "left" and "within 5 s" in e["detail"] for e in q.events)


def test_the_run_ends_for_a_group_that_arrives_after_the_last_step():
    q, _ = make(1, total_steps=1)
    d = boundary(q, {0: (0, [])})
    d = boundary(q, {0: (0, d[0].ranges)})
    d = boundary(q, {0: (1, d[0].ranges)})
    assert d[0].done
    q.register(5, "late", 1)
    assert q.arrive(5, "late", 0, [], False, timeout_s=1).done


def test_after_every_group_died_the_restart_waits_for_every_group():
    q, clock = make(2, dead_after_s=3, start_timeout_s=60)
    d = boundary(q, {0: (0, []), 1: (0, [])})
    d = boundary(q, {g: (0, d[g].ranges) for g in range(2)})
    q.checkpointed(1, "/ckpt/step_1")
    clock.now += 10  # nobody beats: both groups are gone
    assert q.status()["live"] == []
    for g in range(2):
        q.register(g, f"r{g}", 1)
    box = {}
    t = threading.Thread(target=lambda: box.update(d0=q.arrive(0, "r0", 0, [], False, 10)))
    t.start()
    t.join(0.6)
    assert t.is_alive()  # a restart waits for the other group, as the first start does
    box["d1"] = q.arrive(1, "r1", 0, [], False, 10)
    t.join(5)
    assert box["d0"].restore == (1, "/ckpt/step_1") and box["d1"].heal


def test_a_failure_is_one_event_per_attempt_whatever_the_ranks_report():
    """Every rank of an attempt reports the same error: one event. The same rank reporting
    it again is the next attempt, however soon (the driver counts attempts to stop a run
    whose train function always fails; a 30 s merge window once cost a third attempt)."""
    q, _ = make(groups=2)
    for rank in (0, 1):
        q.failed(0, "ValueError: bad", rank)
    q.failed(1, "ValueError: bad", 0)
    assert [(e["group"], e["kind"]) for e in q.events] == [(0, "failed"), (1, "failed")]
    q.failed(0, "ValueError: bad", 0)  # attempt 2 of group 0
    q.failed(0, "ValueError: bad", 1)
    q.failed(0, "KeyError: other", 1)  # another error: its own event
    assert [e["detail"] for e in q.events if e["group"] == 0] == \
        ["ValueError: bad", "ValueError: bad", "KeyError: other"]


def waiting_then_gone(q: Quorum, leave) -> tuple[dict, object]:
    """Groups 0 and 1 pass a boundary; group 0 then waits at the next for group 1 (alive,
    not there yet) until ``leave()`` takes group 1 out. (first decisions, group 0's next)"""
    d = boundary(q, {0: (0, []), 1: (0, [])})
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(d0=q.arrive(0, "a0", 0, d[0].ranges,
                                                                    False, 10)))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # group 1 is alive and not there yet: group 0 waits for it
    leave()
    t.join(5)  # no clock advance: no dead_after_s wait for heartbeats
    assert not t.is_alive() and box["d0"].members == [0]
    return d, box["d0"]


def test_a_failed_attempt_leaves_at_once_and_a_stale_report_drops_nothing():
    """A rank that reports its error with its attempt's id takes that attempt out of the
    quorum at once: the group waiting at the boundary goes on without it, with no clock
    advance (no ``dead_after_s`` wait for heartbeats), and its samples are handed out again.
    A late report from an older attempt leaves the new one alone."""
    q, _ = make(groups=2)
    d, d0 = waiting_then_gone(q, lambda: q.failed(
        1, "RuntimeError: Connection reset by peer", 1, incarnation="a1"))
    left = [e for e in q.events if e["kind"] == "left"]
    assert [(e["group"], e["detail"]) for e in left] == [(1, "its rank 1 failed (the error "
                                                          "above)")]
    assert set(ids(d[1].ranges)) <= set(ids(q.data_state()["queue"])) | set(ids(d0.ranges))
    q.register(1, "b1", 1)  # the next attempt
    q.failed(1, "RuntimeError: old", 0, incarnation="a1")
    assert q.status()["registered"] == [0, 1]


def test_an_attempt_ray_train_saw_end_leaves_at_once_without_a_failed_event():
    """Ray Train's controller saw group 1's attempt end (its worker died: no rank could
    report an error): the group waiting at the boundary goes on at once, with no clock
    advance, and the event says why; no "failed" event (a node coming and going is not
    the code failing, :data:`ray_mesh.raytrain.replica_groups.MAX_FAILS_IN_A_ROW`). The
    next attempt registers and rejoins; a finished run ignores the news."""
    q, _ = make(groups=2)
    waiting_then_gone(q, lambda: q.attempt_ended(
        1, "its attempt ended (rank 0: A worker health check failed.)"))
    assert [(e["kind"], e["group"], e["detail"]) for e in q.events[-1:]] == [
        ("left", 1, "its attempt ended (rank 0: A worker health check failed.)")]
    assert not [e for e in q.events if e["kind"] == "failed"]
    q.attempt_ended(1, "a second poll")  # already gone: nothing more
    assert len([e for e in q.events if e["kind"] == "left"]) == 1
    q.register(1, "b1", 1)
    assert q.status()["registered"] == [0, 1]
    done, _ = make(groups=2, total_steps=1)
    assert all(d.done for d in boundary(done, {0: (1, []), 1: (1, [])}).values())
    done.attempt_ended(0, "after the end")
    assert done.status()["registered"] == [0, 1]


def test_the_beats_name_an_epoch_that_lost_a_member_after_it_formed():
    """Members already on the link of an epoch cannot hear from the quorum through
    ``arrive``: their heartbeats carry the newest epoch that lost a member (0: none), so
    their waits end (ray_mesh.replicas.link); a dropped attempt's beat gets None. A quorum
    formed after the loss has a newer epoch, which no beat names as lost."""
    q, clock = make(groups=3)
    d = boundary(q, {g: (0, []) for g in range(3)})
    epoch = d[0].epoch
    assert [q.beat(g, f"a{g}", 0) for g in range(3)] == [0, 0, 0]
    q.failed(2, "RuntimeError: Connection closed by peer", 1, incarnation="a2")
    assert q.beat(0, "a0", 0) == epoch and q.beat(1, "a1", 0) == epoch
    assert q.beat(2, "a2", 0) is None
    d = boundary(q, {0: (0, d[0].ranges), 1: (0, d[1].ranges)}, fresh=True)
    assert d[0].members == [0, 1] and d[0].epoch > epoch
    assert q.beat(0, "a0", 0) == epoch  # the new epoch is not named
    # A silent loss (a node gone: no report) counts too, found by the others' own beats
    # once the lost group's are older than dead_after_s, with no arrival to notice it.
    clock.now += 3.0
    q.beat(0, "a0", 0)
    clock.now += 3.0
    assert q.beat(0, "a0", 0) == d[0].epoch
    assert [e["group"] for e in q.events if e["kind"] == "left"] == [2, 1]


def test_a_group_that_stays_away_costs_one_new_epoch_not_one_per_step():
    """A departure makes the next quorum a new epoch (new cross-group process groups); the
    quorums after it keep that epoch while the member list stays the same."""
    q, _ = make(groups=3)
    d = boundary(q, {g: (0, []) for g in range(3)})
    q.failed(2, "RuntimeError: gone", 0, incarnation="a2")
    epochs = []
    for step in range(3):
        d = boundary(q, {0: (step, d[0].ranges), 1: (step, d[1].ranges)})
        epochs.append(d[0].epoch)
    assert epochs == [epochs[0]] * 3 and epochs[0] == 2, epochs
    q.register(2, "b2", 1)  # back: a new member list, a new epoch
    d = boundary(q, {2: (0, []), 0: (3, d[0].ranges), 1: (3, d[1].ranges)}, inc={2: "b2"})
    assert d[0].members == [0, 1, 2] and d[0].epoch == 3


def test_a_decision_says_how_long_the_group_waited_for_the_others():
    """What a group spent at the boundary minus this wait is its own cost of meeting the
    quorum, which its pace counts (ray_mesh.replicas.shares): a slow box pays more of it."""
    q, clock = make(groups=2)
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(d0=q.arrive(0, "a0", 0, [], False, 10)))
    t.start()
    t.join(0.3)
    clock.now += 2.0
    d1 = q.arrive(1, "a1", 0, [], False, 10)
    t.join(5)
    assert box["d0"].waited_s == 2.0 and d1.waited_s == 0.0


def test_a_starved_box_whose_beats_come_late_stays_in_and_a_silent_one_still_leaves():
    """A busy box's beats come late, not never: the bound follows their gaps (at most 3x
    dead_after_s), so seconds of starvation do not drop a live group (ray_mesh/replicas/
    liveness.py). A group that stops beating altogether still leaves, in bounded time."""
    q, clock = make(2, dead_after_s=5)
    for _ in range(10):  # group 1's box is starved: its beats come 4 s apart
        for _ in range(4):
            beat_all(q, clock, [0])
        q.beat(1, "a1", 0)
    clock.now += 3
    beat_all(q, clock, [0], dt=3.5)  # 6.5 s since group 1's last beat: past dead_after_s
    assert q.beat(1, "a1", 0) is not None  # still a member (None: dropped)
    for _ in range(16):  # now it goes silent: gone once 15 s (3 x dead_after_s) have passed
        beat_all(q, clock, [0])
    assert q.beat(1, "a1", 0) is None


def test_beats_sweep_for_silent_groups_at_most_once_per_sweep_s():
    """Every beat used to read every group (the sweep for silent ones): at 512 groups of 2
    ranks that was most of a core (benchmarks/scale_quorum.py). Beats within SWEEP_S of
    the last sweep do not sweep; the first one after does, so a silent group still leaves
    within SWEEP_S of its bound."""
    from ray_mesh.replicas import quorum as qm

    q, clock = make(3, dead_after_s=5)
    sweeps = []
    real = q._drop_dead
    q._drop_dead = lambda: (sweeps.append(clock.now), real())[1]
    for _ in range(50):  # 50 beats of groups 0 and 1 at one instant: one sweep
        q.beat(0, "a0", 0)
        q.beat(1, "a1", 0)
    assert len(sweeps) == 1
    clock.now += qm.SWEEP_S / 2
    q.beat(0, "a0", 0)
    assert len(sweeps) == 1
    clock.now = 4.0
    beat_all(q, clock, [0, 1], dt=0)
    assert len(sweeps) == 2
    clock.now = 5.0 + qm.SWEEP_S  # group 2 is silent past its bound: the next beat sweeps
    q.beat(0, "a0", 0)
    assert len(sweeps) == 3 and q.status()["registered"] == [0, 1]  # (status sweeps too)


def test_an_arrival_counts_as_a_beat_of_every_rank_of_the_group():
    q, clock = make(2, dead_after_s=5)
    boundary(q, {0: (0, []), 1: (0, [])})
    clock.now += 4
    t = threading.Thread(target=q.arrive, args=(1, "a1", 1, []), kwargs={"timeout_s": 30},
                         daemon=True)
    t.start()  # group 1 arrives at 4 s but sends no beat: its ranks are alive all the same
    t.join(0.3)
    clock.now += 3  # 7 s after its last beat, 3 s after its arrival
    assert q.beat(0, "a0", 0) is not None
    assert q.beat(1, "a1", 0) is not None  # still a member
    assert not [e for e in q.events if e["kind"] == "left"]


def test_the_bound_follows_the_longest_recent_gap_within_one_and_three_dead_after_s():
    from ray_mesh.replicas.liveness import Beats

    beats = Beats.starting(2, 0.0)
    assert beats.bound(5.0) == 5.0  # no gap seen yet
    beats.beat(0, 0.5)
    beats.beat(1, 3.0)
    assert beats.bound(5.0) == 6.0  # 2 x the 3 s gap of rank 1
    beats.beat(1, 13.0)
    assert beats.bound(5.0) == 15.0  # capped at 3 x dead_after_s
    assert beats.alive(13.0 + 15.0, 5.0) is False  # rank 0 is 27.5 s silent
    assert Beats(2, {0: 0.0}).alive(0.0, 5.0) is False  # a rank never seen


def test_a_leader_waits_in_short_calls_and_the_arrival_stands_between_them():
    """``arrive(wait_s=...)`` returns None while the others are still coming and keeps the
    arrival; ``await_decision`` waits on for the same boundary. A group's other ranks wait
    in a collective while its leader is here: each call stays far below the hang watch's
    bound, however long the others take (replicas/group.py's _quorum)."""
    import time

    q = Quorum(segment_samples=SEG, total_steps=10, expected_groups=2, start_timeout_s=60)
    q.register(0, "a0", 2)
    q.register(1, "a1", 1)
    t0 = time.monotonic()
    assert q.arrive(0, "a0", 0, [], wait_s=0.3) is None
    assert 0.25 < time.monotonic() - t0 < 2
    assert q.await_decision(0, "a0", wait_s=0.2) is None  # still alone: no quorum of one
    d1 = q.arrive(1, "a1", 0, [], wait_s=5)
    d0 = q.await_decision(0, "a0", wait_s=5)
    assert d0 is not None and d1 is not None and d0.members == d1.members == [0, 1]
    assert q.await_decision(0, "a0", wait_s=0.1) is d0  # asked again: the same decision
    with pytest.raises(GroupDropped):
        q.await_decision(0, "another-attempt", wait_s=0.1)


def test_a_decision_names_the_lanes_every_member_has():
    """``lanes``: the smallest member's rank count, the ranks of each group that carry a
    slice of a full-tensor exchange (ray_mesh.replicas.reshard)."""
    clock = Clock()
    q = Quorum(segment_samples=SEG, total_steps=10, expected_groups=3, clock=clock)
    for gid, ranks in ((0, 2), (1, 4), (2, 2)):
        q.register(gid, f"a{gid}", ranks)
    got = boundary(q, {0: (0, []), 1: (0, []), 2: (0, [])})
    assert {g: d.lanes for g, d in got.items()} == {0: 2, 1: 2, 2: 2}
    q.register(1, "b1", 1)  # group 1 again, on 1 rank: its leader carries everything again
    clock.now += 0.5
    got = boundary(q, {0: (1, []), 1: (0, []), 2: (1, [])}, inc={1: "b1"})
    assert {len(d.members) for d in got.values()} == {3}, got
    assert {d.lanes for d in got.values()} == {1}
