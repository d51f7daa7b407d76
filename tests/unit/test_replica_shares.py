"""Unequal boxes: each replica group's segment sized to its measured speed
(ray_mesh.replicas.shares, and the quorum that applies it)."""

from __future__ import annotations

import threading

import pytest

from ray_mesh.replicas.quorum import Quorum
from ray_mesh.replicas.shares import WINDOW, Pace, split_samples


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
