"""The slow rank / slow link analysis on synthetic numbers (ray_mesh.observability.slow)."""

from __future__ import annotations

import pytest

from ray_mesh.network.links import Link, LinkMatrix
from ray_mesh.observability.slow import (
    RankTimes,
    analyze,
    analyze_run,
    format_analysis,
    groups_of,
    times_from_row,
)

NODES = ("10.0.0.1", "10.0.0.2")


def _ranks(shard: dict[int, float], rep: dict[int, float], window: float = 5.0):
    """2 nodes x 2 ranks, dp_replicate across nodes, dp_shard within; shares given."""
    out = []
    for r in range(4):
        node, local = divmod(r, 2)
        waits = {"dp_shard": shard[r] * window, "dp_replicate": rep[r] * window}
        out.append(RankTimes(rank=r, node=NODES[node],
                             coord={"dp_replicate": node, "dp_shard": local},
                             window_s=window, wait_s=waits,
                             compute_s=window * (1 - shard[r] - rep[r])))
    return out


def _matrix(cross: float, within: float = 9000.0) -> LinkMatrix:
    return LinkMatrix([Link(NODES[0], NODES[1], cross), Link(NODES[0], NODES[0], within),
                       Link(NODES[1], NODES[1], within)])


def test_straggler_is_the_rank_that_waits_least():
    # Rank 3 busy: rank 2 waits for it in dp_shard, ranks 0 and 1 in dp_replicate.
    ranks = _ranks(shard={0: 0.02, 1: 0.02, 2: 0.45, 3: 0.03},
                   rep={0: 0.45, 1: 0.44, 2: 0.03, 3: 0.03})
    a = analyze(ranks, _matrix(950))
    assert a.straggler == 3
    assert a.verdict.startswith("slow rank 3 (node 10.0.0.2)"), a.verdict
    assert a.dims["dp_shard"].slowest_rank == 3
    assert a.dims["dp_replicate"].slowest_rank == 3  # not rank 2, which waited in dp_shard
    assert a.dims["dp_replicate"].crosses_nodes and not a.dims["dp_shard"].crosses_nodes
    assert a.slow_link is None


def test_slow_link_names_the_link_and_its_rate():
    ranks = _ranks(shard={r: 0.02 for r in range(4)}, rep={r: 0.7 for r in range(4)})
    a = analyze(ranks, _matrix(19.6))
    assert a.straggler is None
    assert a.slow_link == NODES
    assert a.verdict.startswith("link 10.0.0.1 <-> 10.0.0.2: 20 Mbit/s"), a.verdict
    assert "slower than within a node" in a.verdict and "dp_replicate" in a.verdict
    assert "70%" in a.verdict


def test_slow_node_among_three_is_named():
    ips = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    ranks = [RankTimes(rank=r, node=ips[r], coord={"dp_replicate": r}, window_s=5.0,
                       wait_s={"dp_replicate": 3.0}, compute_s=2.0) for r in range(3)]
    links = LinkMatrix([Link(ips[0], ips[1], 950), Link(ips[0], ips[2], 21),
                        Link(ips[1], ips[2], 19)])
    a = analyze(ranks, links)
    assert a.verdict.startswith("node 10.0.0.3: dp_replicate"), a.verdict
    assert "19 Mbit/s" in a.verdict and "slower than the other links" in a.verdict


def test_healthy_run_has_no_verdict():
    ranks = _ranks(shard={0: 0.05, 1: 0.06, 2: 0.05, 3: 0.07},
                   rep={0: 0.10, 1: 0.12, 2: 0.09, 3: 0.11})
    a = analyze(ranks, _matrix(950))
    assert a.verdict is None and a.straggler is None and a.slow_link is None
    assert "verdict: no slow rank or link" in format_analysis(a.to_json())[-1]


def test_high_cross_wait_without_links_says_so():
    ranks = _ranks(shard={r: 0.0 for r in range(4)}, rep={r: 0.6 for r in range(4)})
    a = analyze(ranks)
    assert "not measured" in a.verdict and "dp_replicate" in a.verdict


def test_too_little_data_no_verdict():
    assert analyze([]).verdict is None
    short = _ranks(shard={r: 0.0 for r in range(4)}, rep={r: 0.9 for r in range(4)},
                   window=0.2)
    assert analyze(short).verdict is None


def test_groups_of_flattened_and_world():
    ranks = _ranks(shard={r: 0 for r in range(4)}, rep={r: 0 for r in range(4)})
    assert sorted(len(g) for g in groups_of(ranks, "dp_shard")) == [2, 2]
    assert [len(g) for g in groups_of(ranks, "dp")] == [4]
    assert [len(g) for g in groups_of(ranks, "world")] == [4]


def test_status_rows_and_samples_round_trip():
    rows = [{"rank": r, "node_ip": NODES[r // 2], "dp_replicate": r // 2, "dp_shard": r % 2,
             "window_s": 5.0, "compute_s": 1.5, "wait_s/dp_replicate": 3.5}
            for r in range(4)]
    rows.append({"rank": 4, "node_ip": NODES[0]})  # no window yet: left out
    samples = [("ray_mesh_link_mbit", {"run": "r1", "a": NODES[0], "b": NODES[1]}, 20.0),
               ("ray_mesh_link_mbit", {"run": "other", "a": NODES[0], "b": NODES[1]}, 900.0)]
    assert times_from_row(rows[-1]) is None
    a = analyze_run(rows, samples, "r1")
    assert a.links == [{"a": NODES[0], "b": NODES[1], "mbit_s": 20.0}]
    assert a.verdict.startswith("link 10.0.0.1 <-> 10.0.0.2: 20 Mbit/s"), a.verdict
    text = "\n".join(format_analysis(a.to_json()))
    assert "link 10.0.0.1 <-> 10.0.0.2: 20 Mbit/s" in text and "dp_replicate" in text


@pytest.mark.parametrize("bad", [0, -1, 2, "fast", True])
def test_wait_sample_s_is_checked(bad):
    from ray_mesh.core.options import check_option_values

    with pytest.raises(ValueError, match="wait_sample_s"):
        check_option_values({"wait_sample_s": bad})


def test_status_shows_slowest_rank_links_and_verdict_in_text_json_and_html():
    """The scraped series -> latest_by_rank -> the analysis, as collect() does per run."""
    import dataclasses
    import json

    from ray_mesh.cli.main import build_parser
    from ray_mesh.status.cluster import ClusterStatus, format_status, latest_by_rank
    from ray_mesh.status.html import render

    samples = []
    for r in range(4):
        tags = {"run": "r1", "rank": str(r), "node_ip": NODES[r // 2]}
        samples += [("ray_mesh_wait_window_seconds", tags, 5.0),
                    ("ray_mesh_compute_seconds", tags, 1.0),
                    ("ray_mesh_dim_wait_seconds", {**tags, "dim": "dp_replicate"}, 3.8),
                    ("ray_mesh_dim_wait_seconds", {**tags, "dim": "dp_shard"}, 0.2)]
    samples.append(("ray_mesh_link_mbit", {"run": "r1", "rank": "0", "a": NODES[0],
                                           "b": NODES[1]}, 18.0))
    metrics = latest_by_rank(samples, "r1")
    assert metrics[2]["wait%(dp_replicate)"] == pytest.approx(76)
    ranks = [{"rank": r, "node": r // 2, "node_ip": NODES[r // 2], "dp_replicate": r // 2,
              "dp_shard": r % 2, **metrics[r]} for r in range(4)]
    slow = analyze_run(ranks, samples, "r1").to_json()
    status = ClusterStatus(dashboard="http://x:8265", runs=[{
        "name": "r1", "id": "abc", "status": "RUNNING", "started": "12:00:00 UTC",
        "mesh": "dp_replicate=2, dp_shard=2", "layout_source": "run dir", "ranks": ranks,
        "slow": slow}])
    text = format_status(status)
    assert "wait%(dp_replicate)" in text and "wait_s/" not in text
    assert "dp_replicate  slowest rank" in text and "[crosses nodes]" in text
    assert f"link {NODES[0]} <-> {NODES[1]}: 18 Mbit/s" in text
    assert f"verdict: link {NODES[0]} <-> {NODES[1]}: 18 Mbit/s" in text
    doc = json.loads(json.dumps(dataclasses.asdict(status), default=str))
    assert doc["runs"][0]["slow"]["slow_link"] == list(NODES)
    assert doc["runs"][0]["slow"]["dims"]["dp_shard"]["crosses_nodes"] is False
    assert "verdict: link 10.0.0.1 &lt;-&gt; 10.0.0.2" in render(status)
    assert build_parser().parse_args(["status", "--json"]).json
