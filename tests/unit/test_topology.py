"""The planner: node alignment, unequal placement, inner dims inside a node, layout table."""

from __future__ import annotations

import logging

import pytest

from ray_mesh.core.spec import MeshSpec
from ray_mesh.core.topology import TopologyError, WorkerReport, plan_mesh
from ray_mesh.observability.layout import layout_table


def workers(per_node: list[int]) -> list[WorkerReport]:
    out, rank = [], 0
    for node, count in enumerate(per_node):
        for local in range(count):
            out.append(WorkerReport(rank=rank, node_id=f"node{node}" + "x" * 20,
                                    node_ip=f"100.64.0.{node + 1}", local_rank=local))
            rank += 1
    return out


def test_hsdp_resolves_against_nodes():
    plan = plan_mesh(MeshSpec.hsdp(), workers([4, 4]))
    assert (plan.spec.dp_replicate, plan.spec.dp_shard) == (2, 4)
    assert plan.num_nodes == 2 and plan.workers_per_node == 4
    assert [plan.node_rank(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert plan.warnings == ()


def test_unequal_workers_per_node_is_refused_with_counts():
    with pytest.raises(TopologyError) as err:
        plan_mesh(MeshSpec.hsdp(), workers([3, 1]))
    msg = str(err.value)
    assert "unequal number of workers" in msg
    assert "100.64.0.1 (node0xxx): 3" in msg and "100.64.0.2 (node1xxx): 1" in msg
    assert "resources_per_worker" in msg


def test_ranks_not_grouped_by_node_are_refused():
    ws = workers([2, 2])
    ws[1], ws[2] = (WorkerReport(1, ws[2].node_id, ws[2].node_ip),
                    WorkerReport(2, ws[1].node_id, ws[1].node_ip))
    with pytest.raises(TopologyError, match="not grouped by node"):
        plan_mesh(MeshSpec(), ws)


def test_tp_cp_larger_than_a_node_is_refused_unless_allowed(caplog):
    with pytest.raises(TopologyError) as err:
        plan_mesh(MeshSpec(tp=4, dp_shard=-1), workers([2, 2]))
    assert "tp*cp = 4*1 = 4 does not divide the 2 workers per node" in str(err.value)
    assert "allow_cross_node_inner=True" in str(err.value)
    with caplog.at_level(logging.WARNING):
        plan = plan_mesh(MeshSpec(tp=4, dp_shard=-1), workers([2, 2]),
                         allow_cross_node_inner=True)
    assert plan.spec.tp == 4 and len(plan.warnings) == 1


def test_cp_counts_with_tp():
    with pytest.raises(TopologyError, match=r"tp\*cp = 2\*2 = 4"):
        plan_mesh(MeshSpec(tp=2, cp=2, dp_shard=-1), workers([2, 2, 2, 2]))


def test_dp_shard_across_nodes_warns_once_with_the_hsdp_fix(caplog):
    with caplog.at_level(logging.WARNING):
        plan = plan_mesh(MeshSpec(dp_shard=-1), workers([2, 2]))
    assert plan.spec.dp_shard == 4
    (warning,) = plan.warnings
    assert "span 2 nodes" in warning and "MeshSpec.hsdp(tp=1, cp=1)" in warning
    assert "dp_replicate=2, dp_shard=2" in warning
    assert sum("span 2 nodes" in r.message for r in caplog.records) == 1


def test_product_mismatch_names_the_cluster():
    with pytest.raises(TopologyError, match=r"2 node\(s\) x 2 worker\(s\)"):
        plan_mesh(MeshSpec(dp_replicate=3, dp_shard=2), workers([2, 2]))


def test_layout_table_has_a_row_per_rank_with_coordinates():
    plan = plan_mesh(MeshSpec(dp_replicate=2, dp_shard=-1), workers([2, 2]))
    table = layout_table(plan, {r: "tailscale0" for r in range(4)})
    lines = table.splitlines()
    assert "dp_replicate=2" in lines[0] and "2 node(s) x 2 worker(s)" in lines[0]
    assert lines[1].split() == ["rank", "node", "node_ip", "local_rank", "device", "interface",
                                "pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert lines[3 + 3].split() == ["3", "1", "100.64.0.2", "1", "cpu", "tailscale0",
                                    "0", "1", "1", "0", "0"]


def test_diloco_that_its_cluster_leaves_one_replica_is_refused_before_any_group():
    """The layout's rule (DiLoCo averages 2 or more replicas) holds for the dims as sized on
    the cluster: ``dp_replicate: nodes`` on one node is refused at planning, naming what the
    dims came to and the fixes, not by ``wrap_replicate`` on every worker after the mesh
    exists. On two nodes the same layout plans."""
    from ray_mesh.core.layout import parse_layout
    from ray_mesh.raytrain.backend import check_resolved

    lay = parse_layout("dp_replicate=nodes,dp_shard=-1/fp32/diloco:every=5")
    with pytest.raises(TopologyError, match=r"mesh dp_replicate=nodes,dp_shard=-1 comes to "
                       r"dp_shard=4 on this cluster \(1 node\(s\), 4 worker\(s\)\).*"
                       r"dp_replicate: 2 \(two replicas on one node\)"):
        check_resolved(lay, plan_mesh(lay.mesh, workers([4])))
    check_resolved(lay, plan_mesh(lay.mesh, workers([2, 2])))  # two replicas: runs
