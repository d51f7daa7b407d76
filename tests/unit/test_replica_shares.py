"""Unequal boxes: each replica group's segment sized to its measured speed
(ray_mesh.replicas.shares, and the quorum that applies it)."""

from __future__ import annotations

import threading

import pytest

from ray_mesh.replicas.quorum import Quorum
from ray_mesh.replicas.shares import WINDOW, Pace, inner_steps, pace_gap, split_samples


def test_equal_until_every_group_has_a_speed():
    assert split_samples(4, {0: (1, None), 1: (1, None)}, "speed") == {0: 4, 1: 4}
    assert split_samples(4, {0: (1, 9.0), 1: (1, None)}, "speed") == {0: 4, 1: 4}
    assert split_samples(4, {0: (1, 9.0), 1: (1, 1.0)}, "equal") == {0: 4, 1: 4}


@pytest.mark.parametrize(("segment", "groups", "want"), [
    (3, {0: (1, 2.0), 1: (1, 1.0)}, {0: 4, 1: 2}),            # twice as fast: twice the batch
    (4, {0: (2, 3.0), 1: (1, 1.0)}, {0: 6, 1: 2}),            # multiples of a group's ranks
    (2, {0: (1, 100.0), 1: (1, 1.0)}, {0: 3, 1: 1}),          # at least one sample per rank
    (5, {0: (2, 2.0), 1: (2, 2.0), 2: (1, 1.0)}, {0: 6, 1: 6, 2: 3}),  # 2 + 2 + 1 devices
    # 20.6, 20.6, 6.8 exact: the 2-rank groups round down to 20, the sample left goes to
    # the 1-rank group, none stays unassigned (the virtual cluster's 2 + 2 + 1 case)
    (16, {0: (2, 30.3), 1: (2, 30.3), 2: (1, 10.0)}, {0: 20, 1: 20, 2: 8}),
])
def test_the_boundary_total_is_split_by_speed(segment, groups, want):
    got = split_samples(segment, groups, "speed")
    assert got == want
    total = segment * len(groups)
    assert sum(got.values()) == total or min(r for r, _ in groups.values()) > 1, got
    assert all(n % groups[g][0] == 0 and n >= groups[g][0] for g, n in got.items())


def test_a_bad_shares_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="shares='fast'"):
        split_samples(4, {0: (1, 1.0)}, "fast")
    with pytest.raises(ValueError, match="shares="):
        Quorum(segment_samples=4, total_steps=10, shares="fast")


def test_the_split_makes_whole_cycles_equal_when_a_boundary_has_a_fixed_cost():
    # boxes 0, 1: 100 samples/s of compute, 0.1 s of boundary; box 2: 30/s and 0.25 s.
    # Equal cycles: T = (96 + 0.1*100*2 + 0.25*30) / 230 = 0.537 s; n = rate * (T - fixed).
    got = split_samples(32, {0: (2, 100.0, 0.1), 1: (2, 100.0, 0.1), 2: (1, 30.0, 0.25)},
                        "speed")
    assert got == {0: 44, 1: 44, 2: 8}, got
    cycles = [0.1 + 44 / 100, 0.1 + 44 / 100, 0.25 + 8 / 30]
    assert max(cycles) - min(cycles) < 0.03, cycles
    # by compute rate alone the slow box would get 96 * 30 / 230 = 12.5 (12): a 0.65 s cycle
    assert split_samples(32, {0: (2, 100.0), 1: (2, 100.0), 2: (1, 30.0)}, "speed")[2] == 12
    # a box whose boundary alone outlasts the others' cycle keeps one sample per rank
    assert split_samples(8, {0: (1, 100.0, 0.0), 1: (1, 10.0, 5.0)}, "speed") == {0: 15, 1: 1}


def test_a_pace_leaves_out_the_warm_up_and_takes_medians():
    p = Pace()
    p.update(8, 8.0, None)            # the first segment: warm-up (1/s), not counted
    assert p.rate is None and p.fixed_s is None and p.speed(8) is None
    p.update(8, 2.0, 0.5)             # 4/s
    assert p.rate == 4.0 and p.fixed_s == 0.5
    assert p.speed(8) == pytest.approx(8 / (0.5 + 2.0))
    p.update(8, 1.0, 1.5)             # 8/s: the median of two is their mean
    assert p.rate == 6.0 and p.fixed_s == 1.0
    p.update(8, 0.1, 0.4)             # a spike (80/s) next to 4 and 8: the median is 8
    assert p.rate == 8.0 and p.fixed_s == 0.5
    p.update(0, None, 0.5)            # a boundary without samples still counts its cost
    assert p.rate == 8.0 and p.fixed_s == 0.5
    for _ in range(WINDOW):           # only the last WINDOW segments count
        p.update(8, 4.0, 0.2)
    assert p.rate == 2.0 and p.fixed_s == 0.2


def test_one_slow_segment_does_not_move_the_split():
    """A hiccup (one segment 4x slower) on the fast box: with a median its share holds
    (the running mean used before gave it 45 samples/s and 42 samples, not 48)."""
    p = Pace()
    for compute_s in (9.0, 0.5, 0.5, 0.5, 2.0):  # warm-up, three steady, one hiccup
        p.update(40, compute_s, 0.1)
    slow = {0: (1, p.rate, p.fixed_s), 1: (1, 20.0, 0.1)}
    assert p.rate == 80.0
    assert split_samples(30, slow, "speed") == {0: 48, 1: 12}


@pytest.mark.parametrize(("held", "per_rank", "segment", "every", "ranks", "sizes"), [
    (64, 64, 128, 16, 2, [4] * 16),            # an equal share: `every` steps
    (23, 23, 128, 16, 2, [4] * 5 + [3]),       # a small share: fewer steps, none empty
    (196, 196, 128, 16, 1, [8] * 24 + [4]),    # a large share: more steps of one size
    (2, 2, 4, 16, 2, [1, 1]),                  # fewer samples than `every`: no empty step
    (7, 8, 8, 4, 2, [1] * 7 + [0]),            # a rank holding one less: the same count
])
def test_inner_steps_keep_one_batch_size_and_every_rank_the_same_count(
        held, per_rank, segment, every, ranks, sizes):
    ids = list(range(100, 100 + held))
    steps = inner_steps(ids, per_rank, segment, every, ranks)
    assert [len(s) for s in steps] == sizes
    assert [i for s in steps for i in s] == ids  # every sample once, in order


def _rounds(split, boxes: dict, segment: int = 128, every: int = 16, rounds: int = 6
            ) -> tuple[list[float], dict]:
    """Simulated DiLoCo rounds under ``shares="speed"``: a group's inner step costs a fixed
    part plus its samples (``boxes``: id -> ranks, fixed s, s per sample); ``split(ids,
    per_rank, ranks)`` makes a rank's inner steps. Returns each round's spread of compute
    (slowest over fastest, minus 1) and the last shares."""
    paces = {g: Pace() for g in boxes}
    shares = {g: segment for g in boxes}
    spread = []
    for _ in range(rounds):
        compute = {}
        for g, (ranks, fixed, per_sample) in boxes.items():
            per_rank = shares[g] // ranks
            steps = [s for s in split(list(range(per_rank)), per_rank, ranks) if s]
            compute[g] = sum(fixed + per_sample * len(s) for s in steps)
            paces[g].update(shares[g], compute[g], 0.1)
        spread.append(max(compute.values()) / min(compute.values()) - 1)
        shares = split_samples(segment, {g: (boxes[g][0], paces[g].rate, paces[g].fixed_s)
                                         for g in boxes}, "speed")
    return spread, shares


def test_with_steps_of_one_size_the_split_settles_after_one_measured_round():
    """DiLoCo on three boxes whose inner step costs a fixed part (the optimizer step, the
    group's collectives) plus its samples; the slow box's is 10x the others'. With
    ``every`` steps per round whatever the share, the slow box pays 16 fixed parts for a
    small share, its rate falls as its share falls, and the split is still chasing it after
    four rounds, and never as close. With steps of one size (:func:`inner_steps`) the rate
    measured at one share holds at the next: settled from the round after the first
    measured one, within what whole steps and whole multiples of a group's ranks allow."""
    segment, every = 128, 16
    boxes = {0: (2, 0.05, 0.004), 1: (2, 0.5, 0.04), 2: (1, 0.05, 0.004)}

    def one_size(ids, per_rank, ranks):
        return inner_steps(ids, per_rank, segment, every, ranks)

    def every_steps(ids, per_rank, ranks):  # the round's `every` steps, batches by share
        per = -(-len(ids) // every)
        return [ids[k * per:(k + 1) * per] for k in range(every)]

    spread, shares = _rounds(one_size, boxes)
    assert spread[0] > 5, spread                 # equal shares: the slow box takes 9x
    assert max(spread[2:]) < 0.15, spread        # warm-up, one measured round, settled
    assert len({round(x, 6) for x in spread[3:]}) == 1, spread  # and it stays
    assert shares[1] <= segment / 8, shares
    chased, _ = _rounds(every_steps, boxes)
    assert min(chased[2:4]) > 1, chased          # rounds 3 and 4 still 2.6x and more
    assert min(chased) > max(spread[2:]), (chased, spread)  # and never as close


def _boundary(q: Quorum, arrivals: dict[int, tuple[int, list, float | None]]) -> dict:
    out, errors = {}, []

    def go(gid: int, step: int, holding: list, busy: float | None) -> None:
        try:
            out[gid] = q.arrive(gid, f"a{gid}", step, holding, timeout_s=10, busy_s=busy)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(g, *a)) for g, a in arrivals.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors, errors
    return out


def test_the_quorum_gives_the_faster_group_the_larger_segment_and_skips_no_sample():
    q = Quorum(segment_samples=6, total_steps=10, expected_groups=2, shares="speed")
    for g in range(2):
        q.register(g, f"a{g}", 1)
    d = _boundary(q, {0: (0, [], None), 1: (0, [], None)})
    assert [sum(n for _, n in d[g].ranges) for g in range(2)] == [6, 6]  # no speed yet
    seen = [r for g in range(2) for r in d[g].ranges]
    # the first segment is warm-up (not counted): still equal
    d = _boundary(q, {0: (0, d[0].ranges, 5.0), 1: (0, d[1].ranges, 5.0)})
    assert [sum(n for _, n in d[g].ranges) for g in range(2)] == [6, 6]
    seen += [r for g in range(2) for r in d[g].ranges]
    # group 0 did its 6 samples in 1 s, group 1 in 2 s: 6/s against 3/s
    d = _boundary(q, {0: (1, d[0].ranges, 1.0), 1: (1, d[1].ranges, 2.0)})
    assert [sum(n for _, n in d[g].ranges) for g in range(2)] == [8, 4]
    seen += [r for g in range(2) for r in d[g].ranges]
    ids = sorted(i for s, n in seen for i in range(s, s + n))
    assert ids == list(range(36))  # every sample once, none skipped
    shares = q.status()["shares"]
    assert shares[0]["samples"] == 8 and shares[1]["samples"] == 4
    assert shares[0]["samples_per_s"] == 6.0 and shares[1]["samples_per_s"] == 3.0


# The virtual cluster's sync job, as its quorum saw it (2026-11-30): the tower's group of
# two ranks does its least share (2 samples) in 0.9 s and its boundary takes 1.3 s; the
# desktop and the laptop compute 18 and 20 samples/s with a 1.2 s boundary.
LAB = {0: (2, 18.0, 1.2), 1: (2, 2.2, 1.3), 2: (1, 20.0, 1.2)}


def test_a_group_at_its_least_share_that_every_step_waits_for_is_named_with_a_segment():
    shares = split_samples(8, LAB, "speed")
    assert shares[1] == 2  # one sample per rank: the split can give it no less
    gap = pace_gap(8, LAB, shares)
    assert gap is not None and gap.group == 1 and gap.samples == 2
    assert gap.cycle_s == pytest.approx(1.3 + 2 / 2.2)
    assert gap.others_s < gap.cycle_s - 0.2
    # at the segment it names, the split fills the tower's cycle: no gap is left
    assert gap.segment > 8
    wider = split_samples(gap.segment, LAB, "speed")
    assert wider[1] == 2 and pace_gap(gap.segment, LAB, wider) is None, wider


@pytest.mark.parametrize("groups", [
    {0: (1, 10.0, 0.5), 1: (1, 5.0, 0.5)},             # the split equalizes: no gap
    {0: (2, 18.0, 1.2), 1: (2, 2.2, 1.0), 2: (1, 20.0, 1.2)},  # a gap under 0.2 s: noise
    {0: (1, 10.0, 0.5), 1: (1, None, 0.5)},            # not measured yet
    {0: (2, 18.0, 1.2)},                               # one group waits for nobody
])
def test_no_group_is_named_where_the_split_can_balance_or_nothing_is_known(groups):
    shares = split_samples(8, groups, "speed")
    assert pace_gap(8, groups, shares) is None


def test_the_quorum_names_the_pacing_group_once_after_its_pace_settles():
    q = Quorum(segment_samples=2, total_steps=50, expected_groups=2, shares="speed")
    for g in range(2):
        q.register(g, f"a{g}", 1)
    d = _boundary(q, {0: (0, [], None), 1: (0, [], None)})
    # group 1's least share (1 sample) takes 2 s; group 0 does 3 samples in 0.1 s
    for step in range(WINDOW + 3):
        d = _boundary(q, {0: (step, d[0].ranges, 0.1), 1: (step, d[1].ranges, 2.0)})
    told = [e for e in q.status()["events"] if e["kind"] == "paces"]
    assert len(told) == 1, told
    assert told[0]["group"] == 1
    assert "least share (1 sample, one per rank)" in told[0]["detail"]
    assert "segment_samples: " in told[0]["detail"] and "now 2" in told[0]["detail"]
    # whole in `ray-mesh status` too: the groups' file keeps a detail of at most MAX_DETAIL
    # (a longer one, 365 characters, once made the file unreadable: issue 43's lab test)
    from ray_mesh.observability.replica_groups import MAX_DETAIL

    assert len(told[0]["detail"]) <= MAX_DETAIL - 25, len(told[0]["detail"])  # room: figures
    # not before the window is full: the warm-up and WINDOW measured segments
    assert told[0]["step"] >= WINDOW


def test_the_console_line_says_sets_the_pace():
    from ray_mesh.raytrain.replica_groups import describe

    line = describe({"kind": "paces", "group": 1, "step": 7, "detail": "x"})
    assert line == "replica group 1 sets the pace at step 7: x"


def test_at_equal_shares_a_slow_group_is_named_with_the_speed_split_as_the_fix():
    groups = {0: (1, 10.0, 0.5), 1: (1, 2.0, 0.5)}
    equal = split_samples(4, groups, "equal")
    gap = pace_gap(4, groups, equal, "equal")
    assert gap is not None and gap.group == 1 and gap.fix == "speed"
    assert gap.samples == 4 and gap.samples_by_speed == split_samples(4, groups, "speed")[1]
    assert gap.samples_by_speed < 4
    # the speed split closes it: nothing to say then
    assert pace_gap(4, groups, split_samples(4, groups, "speed"), "speed") is None


def test_the_quorum_at_equal_shares_points_to_the_speed_split():
    q = Quorum(segment_samples=4, total_steps=50, expected_groups=2, shares="equal")
    for g in range(2):
        q.register(g, f"a{g}", 1)
    d = _boundary(q, {0: (0, [], None), 1: (0, [], None)})
    for step in range(WINDOW + 3):  # group 1 computes its 4 samples in 2 s, group 0 in 0.2
        d = _boundary(q, {0: (step, d[0].ranges, 0.2), 1: (step, d[1].ranges, 2.0)})
    told = [e for e in q.status()["events"] if e["kind"] == "paces"]
    assert len(told) == 1 and told[0]["group"] == 1, told
    assert "at equal shares (4 samples each)" in told[0]["detail"]
    assert "shares: speed" in told[0]["detail"]
