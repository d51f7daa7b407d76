"""Which pairs a link measurement runs, and judging a large matrix
(ray_mesh.network.links: link_rounds, LinkMatrix past FULL_MESH_NODES nodes)."""

from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest

from ray_mesh.network.links import (
    SAMPLED_ROUNDS,
    Link,
    LinkMatrix,
    _median_without,
    link_rounds,
    pair_rounds,
)
from ray_mesh.network.pairs import FULL_MESH_NODES


@pytest.mark.parametrize("n", [2, 3, 8, FULL_MESH_NODES])
def test_every_pair_up_to_the_full_mesh_size(n):
    assert link_rounds(n) == pair_rounds(n)
    assert sorted(p for r in link_rounds(n) for p in r) == [
        (i, j) for i in range(n) for j in range(i + 1, n)]


@pytest.mark.parametrize("n", [FULL_MESH_NODES + 1, 32, 129, 512])
def test_past_it_a_fixed_number_of_rounds_each_node_against_distinct_peers(n):
    rounds = link_rounds(n, seed=7)
    assert len(rounds) == SAMPLED_ROUNDS
    peers: dict[int, list[int]] = {i: [] for i in range(n)}
    for r in rounds:
        in_round = [x for pair in r for x in pair]
        assert len(in_round) == len(set(in_round))  # disjoint: no node twice in a round
        for a, b in r:
            peers[a].append(b)
            peers[b].append(a)
    for node, mine in peers.items():
        assert len(mine) == len(set(mine)), node  # no pair twice
        assert len(mine) >= SAMPLED_ROUNDS - (n % 2), (node, mine)
    # another run draws other rounds; a seed draws the same
    assert link_rounds(n, seed=7) == rounds
    assert any(link_rounds(n, seed=s) != rounds for s in range(8, 12))


def test_the_median_without_some_values_matches_the_plain_median():
    rng = random.Random(3)
    for _ in range(300):
        values = sorted(rng.choice([1.0, 2.0, 5.0, 9.0]) + rng.randrange(3)
                        for _ in range(rng.randrange(2, 40)))
        skip = sorted(rng.sample(values, rng.randrange(0, len(values))))
        left = Counter(values) - Counter(skip)
        assert _median_without(values, skip) == statistics.median(left.elements())
    with pytest.raises(ValueError):
        _median_without([1.0], [1.0])


def _sampled_matrix(n: int, slow_node: int, relayed: tuple[int, int] | None) -> LinkMatrix:
    names = [f"10.0.{i // 200}.{i % 200 + 1}" for i in range(n)]
    links = []
    for r in link_rounds(n, seed=1) + ([[relayed]] if relayed else []):
        for a, b in r:
            rate = 100.0 + (a * 7 + b) % 11
            if slow_node in (a, b):
                rate = 30.0
            if relayed and {a, b} == set(relayed):
                rate = 5.0
            links.append(Link(names[a], names[b], rate))
    links += [Link(x, x, 5000.0) for x in names]
    return LinkMatrix(links)


def test_a_sampled_512_node_matrix_names_the_slow_node_and_the_relayed_pair():
    n = 512
    m = _sampled_matrix(n, slow_node=300, relayed=(17, 301))
    slow = "10.0.1.101"  # node 300
    assert m.slow_nodes() == [slow]
    assert m.verdict().startswith(f"node {slow}: links at most 30 Mbit/s")
    assert [(x.a, x.b) for x, _ in m.relayed()] == [("10.0.0.18", "10.0.1.102")]
    text = m.format()
    lines = text.splitlines()
    assert lines[0].split() == ["Mbit/s", "links", "slowest", "median", "fastest", "within"]
    assert len(lines) < n + 10  # a line per node, not a 512-column table
    row = next(x for x in lines if x.split()[0] == slow).split()
    assert row[1:] == [str(SAMPLED_ROUNDS), "30", "30", "30", "5000"]


def test_up_to_the_full_mesh_size_the_table_is_node_by_node():
    m = _sampled_matrix(4, slow_node=3, relayed=None)
    header = m.format().splitlines()[0].split()
    assert header == ["Mbit/s", *m.nodes()]


def test_a_table_names_the_five_slowest_relayed_links_then_counts_the_rest():
    names = [f"10.1.0.{i + 1}" for i in range(40)]
    links = [Link(names[a], names[b], 100.0) for r in link_rounds(40, seed=2) for a, b in r]
    slow = links[:9]
    links = [Link(x.a, x.b, 2.0 + k) for k, x in enumerate(slow)] + links[9:]
    m = LinkMatrix(links)
    hints = m.relay_hints()
    assert len(hints) == 6 and hints[-1].startswith("... and 4 more link(s)"), hints
    assert hints[0].startswith(f"link {slow[0].a} <-> {slow[0].b}: 2.0 Mbit/s")
    assert len(m.relay_hints(most=None)) == 9  # `ray-mesh doctor --json`: every one
    assert "a line per node" in m.caption()
    assert "row sends to column" in LinkMatrix(links[:3]).caption()
