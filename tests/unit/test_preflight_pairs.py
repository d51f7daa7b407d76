"""The pre-flight's choice of node pairs past 16 nodes (``ray_mesh.network.pairs``): pure logic.

Up to 16 nodes every ordered pair is checked, as before. Past that a bounded set, and these
tests hold it to the guarantees the module names: the head both ways, every cut crossed
both ways, every node checked from several sides with short paths between any two, the
layout's neighbours, about n(log2 n + 3) connections; and the report names a node cut off.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter, deque

import pytest

from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.network.pairs import (
    FULL_MESH_NODES,
    all_pairs,
    check_pairs,
    finger_count,
    isolated,
    layout_pairs,
)
from ray_mesh.network.probe import ConnectResult, NodeFacts
from ray_mesh.network.report import NodeTarget, PreflightReport, find_problems


def test_up_to_16_nodes_every_ordered_pair_as_before():
    for n in (0, 1, 2, 3, FULL_MESH_NODES):
        assert check_pairs(n, seed=7) == all_pairs(n)
        assert len(all_pairs(n)) == n * (n - 1)


@pytest.mark.parametrize("n", [17, 32, 100, 128, 512, 1000])
def test_past_16_nodes_about_n_log_n_connections(n):
    pairs = check_pairs(n, seed=n)
    assert len(set(pairs)) == len(pairs) and all(i != j for i, j in pairs)
    assert len(pairs) <= n * (finger_count(n) + 2) + (n - 1)
    assert len(pairs) < n * (n - 1)
    out = Counter(i for i, _ in pairs)
    into = Counter(j for _, j in pairs)
    for i in range(1, n):  # every node but the head: a bounded number each way (a partner
        # may also be a ring neighbour)
        assert finger_count(n) <= out[i] <= finger_count(n) + 2
        assert finger_count(n) <= into[i] <= finger_count(n) + 3
    assert out[0] == n - 1  # the head tries every node


@pytest.mark.parametrize("n", [17, 33, 128])
def test_the_head_reaches_every_node(n):
    pairs = set(check_pairs(n, seed=1))
    assert all((0, j) in pairs for j in range(1, n))


def test_every_cut_is_crossed_both_ways():
    """Any split into two non-empty sets: a checked pair from each side to the other (a
    partition between sites fails a check whichever way it blocks)."""
    rng = random.Random(3)
    for n in (17, 40, 128):
        pairs = check_pairs(n, seed=rng.randrange(2**32))
        for _ in range(300):
            side = {i for i in range(n) if rng.random() < rng.random()}
            if not side or len(side) == n:
                continue
            assert any(i in side and j not in side for i, j in pairs)
            assert any(i not in side and j in side for i, j in pairs)
        for k in range(1, n):  # the contiguous splits too (one site = a block of nodes)
            side = set(range(k))
            assert any(i in side and j not in side for i, j in pairs)
            assert any(i not in side and j in side for i, j in pairs)


def _hops(n, pairs, start):
    nxt = {}
    for i, j in pairs:
        nxt.setdefault(i, []).append(j)
    dist, queue = {start: 0}, deque([start])
    while queue:
        i = queue.popleft()
        for j in nxt.get(i, []):
            if j not in dist:
                dist[j] = dist[i] + 1
                queue.append(j)
    return dist


@pytest.mark.parametrize("n", [17, 64, 200])
def test_any_two_nodes_are_within_log2_n_checked_hops_without_the_head(n):
    pairs = [(i, j) for i, j in check_pairs(n, seed=5) if i != 0 and j != 0]
    for start in range(1, n, max(1, n // 10)):
        dist = _hops(n, pairs, start)
        assert len(dist) == n - 1  # everyone but the head
        assert max(dist.values()) <= math.ceil(math.log2(n)) + 1


def test_partners_change_from_run_to_run_and_repeat_with_a_seed():
    assert check_pairs(64, seed=1) == check_pairs(64, seed=1)
    a, b = set(check_pairs(64, seed=1)), set(check_pairs(64, seed=2))
    assert a != b
    union = set()
    for seed in range(200):  # over many runs, most pairs get a turn
        union |= set(check_pairs(64, seed=seed))
    assert len(union) > 0.95 * 64 * 63


def _plan_pairs(spec, nodes, per_node):
    spec = MeshSpec.from_dict(spec).resolve(nodes * per_node, num_nodes=nodes)
    coords = [spec.coordinate(r) for r in range(nodes * per_node)]
    dims = [d for d in DIM_NAMES if getattr(spec, d) > 1]
    return layout_pairs([r // per_node for r in range(nodes * per_node)],
                        [{d: c[d] for d in DIM_NAMES} for c in coords], dims)


def test_layout_pairs_are_the_cross_node_neighbours_of_each_dim():
    # HSDP, 8 ranks a node: dp_replicate's ring over the nodes, dp_shard within a node.
    assert _plan_pairs({"dp_replicate": "nodes", "dp_shard": -1}, 32, 8) == \
        {(i, i + 1) for i in range(31)} | {(0, 31)}
    # 4 pipeline stages over 64 nodes, HSDP inside a stage: a stage's node talks to the same
    # place in the next stage (16 nodes on), and the ring of its replicas.
    pairs = _plan_pairs({"pp": 4, "dp_replicate": -1, "dp_shard": 8}, 64, 8)
    assert {(i, i + 16) for i in range(48)} <= pairs
    assert all(b - a in (1, 15, 16, 48) for a, b in pairs), sorted(pairs)[:20]
    # One node: nothing crosses.
    assert _plan_pairs({"dp_shard": -1}, 1, 8) == set()


def test_layout_pairs_are_checked_both_ways():
    layout = {(3, 40), (7, 90)}
    pairs = set(check_pairs(128, seed=9, layout=layout))
    assert {(3, 40), (40, 3), (7, 90), (90, 7)} <= pairs
    assert (5, 5) not in set(check_pairs(128, layout={(5, 5), (1, 999)}))


def test_isolated_names_a_node_none_of_whose_checks_succeeded():
    n = 40
    pairs = check_pairs(n, seed=11)
    blocked_out, blocked_in = 7, 23
    results = {(i, j): i != blocked_out and j != blocked_in for i, j in pairs}
    assert isolated(n, results, min_checks=3) == ([blocked_out], [blocked_in])
    assert isolated(n, {p: True for p in pairs}) == ([], [])


def _report(n, results):
    facts = [NodeFacts(index=i, node_ip=f"10.0.0.{i}", hostname=f"h{i}", token="t")
             for i in range(n)]
    report = PreflightReport([NodeTarget(f"10.0.0.{i}") for i in range(n)], facts,
                             pairs=list(results))
    report.matrix = {p: ConnectResult(ok) for p, ok in results.items()}
    return report


def test_the_report_names_a_cut_off_node_once_and_counts_per_node():
    n = 20
    results = {p: p[1] != 13 for p in check_pairs(n, seed=4)}
    report = _report(n, results)
    lines = find_problems(report, [])
    cut = [x for x in lines if "was reached by none of the" in x]
    assert len(cut) == 1 and "node 13 (10.0.0.13" in cut[0], lines
    text = report.format()
    assert "connectivity:" in text and "node 13" in text
    assert "node x node" not in text and "from\\to" not in text  # no n x n table past 16
    table = text.split("connectivity:", 1)[1]
    row = next(x for x in table.splitlines() if x.startswith("node 13 "))
    assert f"0/{sum(1 for _, j in results if j == 13)}" in row


def test_up_to_16_nodes_the_matrix_table_and_no_cut_off_line():
    results = {p: p[1] != 2 for p in all_pairs(4)}
    report = _report(4, results)
    assert "from\\to" in report.format()
    assert not [x for x in find_problems(report, []) if "none of the" in x]


def test_pairs_stay_in_range_and_sorted():
    for n, seed in itertools.product((17, 50), (None, 1, 2)):
        pairs = check_pairs(n, seed=seed)
        assert pairs == sorted(pairs)
        assert all(0 <= i < n and 0 <= j < n for i, j in pairs)
    with pytest.raises(ValueError):
        check_pairs(-1)
