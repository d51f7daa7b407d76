"""Bad values for the mesh spec and the plan: a clear MeshSpecError/TopologyError, never a
TypeError, ZeroDivisionError or a silently wrong answer (the security issue's classes)."""

from __future__ import annotations

import pytest

from ray_mesh.core.spec import MeshSpec, MeshSpecError
from ray_mesh.core.topology import TopologyError, plan_mesh


@pytest.mark.parametrize("world", [True, False, "4", 4.0, float("nan"), 0, -4, None, [4]])
def test_resolve_refuses_a_world_size_that_is_not_a_positive_int(world):
    with pytest.raises(MeshSpecError, match="world_size must be an int >= 1"):
        MeshSpec().resolve(world)


@pytest.mark.parametrize("nodes", [0, -1, 2.0, "2", True])
def test_resolve_refuses_a_bad_node_count(nodes):
    with pytest.raises(MeshSpecError, match="num_nodes must be an int >= 1"):
        MeshSpec.hsdp().resolve(4, num_nodes=nodes)


@pytest.mark.parametrize("rank", [100, 4, -1, True, 1.0, "1"])
def test_coordinate_refuses_ranks_outside_the_mesh(rank):
    with pytest.raises(MeshSpecError, match="is not a rank of"):
        MeshSpec(dp_shard=4).resolve(4).coordinate(rank)


def test_coordinate_still_answers_every_real_rank():
    spec = MeshSpec(dp_replicate=2, dp_shard=2).resolve(4)
    assert [spec.coordinate(r)["dp_shard"] for r in range(4)] == [0, 1, 0, 1]


def test_plan_mesh_with_no_workers_says_so():
    with pytest.raises(TopologyError, match="worker group is empty"):
        plan_mesh(MeshSpec(), [])
