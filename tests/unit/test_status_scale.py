"""``ray-mesh status`` past one machine: what keeps it within seconds at hundreds of nodes.

The parser reads only the ``ray_mesh_*`` lines, as ``prometheus_client`` would; rank 0
exports a bounded set of links past 16 nodes (:meth:`LinkMatrix.exported`) that still names
a slow node; the console lists the slowest links, not all; the HTML page draws a bounded
number of arcs; and the bring-up hands the links and the layout table to rank 0 only.
No Ray connection, no sockets.
"""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ray_mesh.network.links import EXPORT_ALL_NODES, Link, LinkMatrix
from ray_mesh.observability.slow import LINK_LINES, format_analysis
from ray_mesh.observability.status_input import clean_samples
from ray_mesh.status.cluster import ClusterStatus
from ray_mesh.status.html import MAX_ARCS, mesh_svg
from ray_mesh.status.metrics import parse_series

PAGE = """# HELP ray_node_cpu Ray's own series, skipped
# TYPE ray_node_cpu gauge
ray_node_cpu{Component="raylet",NodeAddress="10.0.0.1"} 3.5
# HELP ray_mesh_step Last reported training step ('step' key).
# TYPE ray_mesh_step gauge
ray_mesh_step{Component="core_worker",run="r1",rank="0",node_ip="10.0.0.1",pp="0"} 120.0
ray_mesh_step{run="r1",rank="1",odd="q\\\\\\"uo}te",nl="a\\nb",tab="x\\ty",empty=""} 7
ray_mesh_step{run="r1",rank="2" , x = "y" ,} 1.5e3
ray_mesh_step 9
ray_mesh_step{} NaN
# HELP ray_mesh_steps_total Training steps done.
# TYPE ray_mesh_steps_total counter
ray_mesh_steps_total{run="r1",rank="0"} +Inf 1700000000000
ray_mesh_steps_total{run="r1",rank="1"} -Inf
ray_mesh_steps_created{run="r1",rank="1"} 1.7e9
"""


def _reference(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for family in text_string_to_metric_families(text):
        out += [(s.name, dict(s.labels), float(s.value)) for s in family.samples
                if s.name.startswith("ray_mesh_")]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] == y[1] and (x[2] == y[2] or math.isnan(x[2]) and math.isnan(y[2]))
        for x, y in zip(a, b, strict=True))


def test_the_parser_reads_what_prometheus_client_reads():
    got = parse_series(PAGE)
    assert _same(got, _reference(PAGE)), got
    assert got[1][1] == {"run": "r1", "rank": "1", "odd": 'q\\"uo}te', "nl": "a\nb",
                         "tab": "x\\ty", "empty": ""}
    assert all(name.startswith("ray_mesh_") for name, _, _ in got)


def test_a_generated_page_of_many_ranks_reads_the_same():
    lines = []
    for r in range(300):
        tags = ",".join(f'{k}="{v}"' for k, v in (
            ("SessionName", "session_1"), ("run", "big"), ("rank", r), ("node_ip", f"10.0.{r}.1"),
            ("pp", 0), ("dp_replicate", r // 8), ("dp_shard", r % 8), ("dim", "dp_shard")))
        lines += [f"ray_mesh_dim_wait_seconds{{{tags}}} {r / 7}",
                  f'ray_other{{rank="{r}"}} 1']
    text = "\n".join(lines) + "\n"
    assert _same(parse_series(text), _reference(text))


@pytest.mark.parametrize("line", [
    'ray_mesh_step{run="r1" 1',            # no closing brace
    'ray_mesh_step{run=r1} 1',             # unquoted value
    'ray_mesh_step{run="r1"}',             # no value
    'ray_mesh_step{run="r1"} 1_000',       # float() would take it, Prometheus does not
    'ray_mesh_step{run="r1"} one',
    'ray_mesh_step{"r1"} 1',
])
def test_a_malformed_ray_mesh_line_fails_the_page(line):
    with pytest.raises(ValueError):
        parse_series(f"ray_mesh_ok 1\n{line}\n")


def test_lines_of_other_series_are_not_parsed():
    junk = "<html>not metrics</html>\nray_other{broken 1\n# TYPE x gauge\n"
    assert parse_series(junk + "ray_mesh_step 3\n") == [("ray_mesh_step", {}, 3.0)]


def test_clean_samples_escapes_each_value_once_and_still_drops_bad_ones():
    samples = [("ray_mesh_step", {"run": "r\x1b[2J", "rank": str(r)}, 1.0) for r in range(50)]
    samples.append(("ray_mesh_step", {"rank": "²"}, 1.0))
    clean, dropped = clean_samples(samples)
    assert dropped == 1 and len(clean) == 50
    assert {c[1]["run"] for c in clean} == {"r\\x1b[2J"}


def _matrix(n: int, slow: int | None = None) -> LinkMatrix:
    ips = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(n)]
    links = [Link(ips[i], ips[i], 20000.0) for i in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            rate = 100.0 if slow in (i, j) else 800.0 + (i * 31 + j * 17) % 200
            links.append(Link(ips[i], ips[j], rate))
    return LinkMatrix(links)


def test_up_to_16_nodes_every_link_is_exported():
    m = _matrix(EXPORT_ALL_NODES)
    assert m.exported().links == m.links


@pytest.mark.parametrize("n", [17, 64, 200])
def test_past_16_nodes_at_most_three_links_a_node_with_the_slowest_and_each_fastest(n):
    m = _matrix(n)
    kept = m.exported()
    assert len(kept.links) <= 3 * n and len(kept.links) < len(m.links)
    assert kept.cross_node_mbit() == m.cross_node_mbit()  # the slowest link of all
    assert sum(1 for x in kept.links if x.a == x.b) == n  # every within-node link
    for node in m.nodes():
        mine = [x.mbit_s for x in m.cross() if node in (x.a, x.b)]
        kept_mine = [x.mbit_s for x in kept.cross() if node in (x.a, x.b)]
        assert max(kept_mine) == max(mine) and min(kept_mine) == min(mine)


def test_a_slow_node_is_still_named_from_the_exported_links():
    m = _matrix(40, slow=13)
    assert m.slow_nodes() == ["10.0.0.14"]  # node 13's address
    assert m.exported().slow_nodes() == m.slow_nodes()
    assert _matrix(40).exported().slow_nodes() == []


def test_the_console_lists_the_slowest_links_and_counts_the_rest():
    links = [{"a": f"n{i}", "b": f"n{i + 1}", "mbit_s": 900.0 - i} for i in range(40)]
    lines = format_analysis({"dims": {}, "links": links, "verdict": None})
    shown = [x for x in lines if "<->" in x]
    assert len(shown) == LINK_LINES
    assert "n39 <-> n40: 861 Mbit/s" in shown[0]  # the slowest first
    assert any(f"{40 - LINK_LINES} more link(s), up to 900 Mbit/s" in x for x in lines)
    few = format_analysis({"dims": {}, "links": links[:3], "verdict": None})
    assert [x for x in few if "<->" in x][0].strip().startswith("link n0 <-> n1")


def test_the_page_draws_a_bounded_number_of_arcs():
    n = 60
    nodes = [{"node_id": f"id{i}", "ip": f"10.0.0.{i}", "state": "ALIVE", "head": i == 0,
              "CPU": 8.0, "GPU": 0.0} for i in range(n)]
    ranks = [{"rank": i, "node_ip": f"10.0.0.{i}", "dp_replicate": i} for i in range(n)]
    links = [{"a": f"10.0.0.{i}", "b": f"10.0.0.{j}", "mbit_s": 900.0}
             for i in range(n) for j in range(i + 1, n)]
    svg = mesh_svg(ClusterStatus(dashboard="x", nodes=nodes), {"ranks": ranks}, links)
    drawn = len(re.findall(r'<g class="link">', svg))
    assert drawn == (n - 1) + MAX_ARCS  # every neighbour link, a bounded number of arcs


def test_the_bring_up_hands_links_and_the_table_to_rank_0_only():
    from ray_mesh.core.spec import MeshSpec
    from ray_mesh.core.topology import WorkerReport, plan_mesh
    from ray_mesh.network.interfaces import Choice
    from ray_mesh.raytrain.backend import MeshConfig, _setups

    reports = [WorkerReport(rank=r, node_id=f"node{r // 2}" + "x" * 20,
                            node_ip=f"100.64.0.{r // 2 + 1}", local_rank=r % 2)
               for r in range(6)]
    plan = plan_mesh(MeshSpec.hsdp(), reports)
    choices = [Choice("tailscale0", w.node_ip, "AF_INET", "test") for w in reports]
    links = [{"a": "100.64.0.1", "b": "100.64.0.2", "mbit_s": 900.0}]
    setups = _setups(plan, choices, MeshConfig(mesh="hsdp"), {}, "TABLE", None, links)
    assert setups[0].links == links and setups[0].layout_table == "TABLE"
    assert all(s.links is None and s.layout_table == "" for s in setups[1:])
