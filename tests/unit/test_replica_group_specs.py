"""Replica groups of unequal layouts: the group specs (checked on the driver), the exchange
they imply, the groups of a live cluster's nodes, and the unequal-nodes plan."""

from __future__ import annotations

import pytest

from ray_mesh.planning.cluster import NodeInfo
from ray_mesh.planning.cost import ModelStats, PlanError, Workload
from ray_mesh.planning.groups import groups_from_nodes, plan_groups
from ray_mesh.replicas.layouts import GroupLayoutError, GroupSpec, exchange_for, group_specs


def test_equal_groups_share_shards_and_unequal_ones_exchange_full_tensors():
    same = group_specs(3, 2)
    assert [s.label for s in same] == ["dp_shard=2"] * 3 and exchange_for(same) == "shards"
    mixed = group_specs([{"dp_shard": 2}, {"mesh": {"tp": 2}, "node": "100.64.0.2"},
                         GroupSpec({"dp_shard": 1})])
    assert [(s.label, s.workers, s.node) for s in mixed] == [
        ("dp_shard=2", 2, None), ("tp=2", 2, "100.64.0.2"), ("dp_shard=1", 1, None)]
    assert exchange_for(mixed) == "full"
    assert group_specs([{"tp": 2, "dp_shard": 2}])[0].label == "dp_shard=2,tp=2"  # mesh order


@pytest.mark.parametrize(("groups", "workers", "why"), [
    (0, 2, "both must be at least 1"),
    ([{"dp_shard": 2}], 2, "workers_per_group goes with groups=N"),
    ([], None, "a number of groups or a list"),
    ("three", None, "a number of groups or a list"),
    ([{"dp_replicate": 2}], None, "dp_replicate is the groups themselves"),
    ([{"dp_shard": -1}], None, "whole number of workers"),
    ([{"dp_shard": True}], None, "whole number of workers"),
    ([{"mesh": {"dp_shard": 1}, "host": "x"}], None, "unknown key"),
    ([{"mesh": {"dp_shard": 1}, "node": ""}], None, "node's address"),
    ([["dp_shard", 2]], None, "mapping of dim sizes"),
])
def test_a_bad_group_layout_names_the_group_and_the_fix(groups, workers, why):
    with pytest.raises(GroupLayoutError, match=why):
        group_specs(groups, workers)


def _node(ip: str, slots: float, alive: bool = True) -> NodeInfo:
    return NodeInfo(node_id=ip, ip=ip, cpus=4, resources={"slot": slots}, alive=alive)


def test_auto_groups_are_one_per_alive_node_over_its_slots():
    nodes = [_node("a", 2), _node("b", 2), _node("c", 1), _node("d", 0),
             _node("e", 4, alive=False)]
    specs = groups_from_nodes(nodes, "slot")
    assert [(s.label, s.node) for s in specs] == [
        ("dp_shard=2", "a"), ("dp_shard=2", "b"), ("dp_shard=1", "c")]
    with pytest.raises(GroupLayoutError, match="no alive node has 1 GPU"):
        groups_from_nodes(nodes, "GPU")


def test_the_plan_sizes_shares_by_devices_and_speed_and_compares_the_alternatives():
    stats = ModelStats(params=1_000_000, layers=4, hidden=256, heads=4)
    work = Workload(tokens=4096, compute_s=5.0)
    plan = plan_groups([2, 2, 1], [1.0, 1.0, 0.5], stats, work, cross_mbit=1000)
    assert [round(s.share, 3) for s in plan.shares] == [0.444, 0.444, 0.111]
    assert plan.compute_s == pytest.approx(5.0 / 4.5)
    assert plan.exchange_s == pytest.approx(2 * 2 / 3 * 4e6 * 8 / 1e9)  # ring, fp32
    assert plan.equal_step_s == pytest.approx(5.0 / 3 / 0.5 + plan.exchange_s)
    assert plan.leave_out_step_s == pytest.approx(5.0 / 4 + plan.exchange_s)
    assert plan.left_out == [2]
    text = "\n".join(plan.lines())
    assert "node 2: 1 worker(s), layout dp_shard=1, speed 0.5 per device, share 11%" in text
    assert "vs equal shares" in text and "nodes 2 left out" in text
    with pytest.raises(PlanError, match="one per node"):
        plan_groups([2, 1], [1.0], stats, work, cross_mbit=100)


def test_the_job_file_takes_a_replica_groups_section():
    from pathlib import Path

    from ray_mesh.cli.job import Job

    root = Path(__file__).resolve().parents[2]
    job = Job.from_yaml(root / "examples" / "replica_groups.yaml")
    rg = job.replica_groups
    assert rg.workers() == 3 and rg.shares == "speed" and rg.steps == 20
    assert rg.fit_kwargs()["groups"] == [{"dp_shard": 2}, {"dp_shard": 1}]
    assert Job.from_dict({"train": "x.py:f", "replica_groups": {
        "groups": "auto", "steps": 5, "segment_samples": 4}}).replica_groups.workers() is None


@pytest.mark.parametrize(("extra", "section", "why"), [
    ({"mesh": {"dp_shard": 2}}, {}, "mesh: does not go with replica_groups"),
    ({"layout": "fsdp"}, {}, "layout: does not go with replica_groups"),
    ({"scaling": {"num_workers": 4}}, {}, "each group's size is its layout"),
    ({"run": {"min_workers": 1}}, {}, "groups leave and rejoin on their own"),
    ({}, {"shares": "fast"}, "replica_groups.shares: 'fast'"),
    ({}, {"steps": 0}, "replica_groups.steps"),
    ({}, {"groups": [{"pp": 2}]}, "replica_groups.groups: replica group 0: dim 'pp'"),
    ({"run": {"startup_retries": 2}}, {}, "run.startup_retries does not go with"),
    ({"scaling": {"placement_strategy": "SPREAD"}}, {}, "packed on one node"),
    ({"run": {"max_failures": 3}}, {"max_group_failures": 5}, "keep one of them"),
    ({}, {"max_group_failures": -2}, "replica_groups.max_group_failures"),
    ({}, {"segment": 4}, "Unknown key 'segment'"),
])
def test_a_bad_replica_groups_job_is_refused_with_the_fix(extra, section, why):
    from ray_mesh.cli.job import Job, JobError

    groups = {"groups": [{"dp_shard": 1}], "steps": 5, "segment_samples": 4, **section}
    with pytest.raises(JobError, match=why):
        Job.from_dict({"train": "x.py:f", "replica_groups": groups, **extra})


def test_every_run_key_of_a_groups_job_reaches_the_groups():
    """run.max_failures is each group's restart budget, and checkpoint_every alone puts
    the fallback checkpoints in the run's storage (checkpoint_dir left out)."""
    from ray_mesh.cli.job import Job

    groups = {"groups": [{"dp_shard": 1}], "steps": 5, "segment_samples": 4,
              "checkpoint_every": 2}
    job = Job.from_dict({"train": "x.py:f", "replica_groups": groups, "run": {
        "storage_path": "s3://bucket/runs", "storage_endpoint": "http://10.0.0.5:9000",
        "max_failures": -1, "num_to_keep": 2}})
    kwargs = job.replica_groups.fit_kwargs()
    assert kwargs["max_group_failures"] == -1 and kwargs["checkpoint_dir"] is None
    assert kwargs["checkpoint_every"] == 2
    assert Job.from_dict({"train": "x.py:f", "replica_groups": groups}).replica_groups \
        .max_group_failures == 20  # the section's default without run.max_failures


def test_the_live_plan_lists_one_group_per_node_with_calibrated_shares():
    from ray_mesh.planning.groups import format_node_groups

    specs = groups_from_nodes([_node("a", 2), _node("b", 2), _node("c", 1)], "slot")
    text = format_node_groups(specs, {"a": 100.0, "b": 100.0, "c": 40.0})
    assert "group 2: node c, 1 worker(s), layout dp_shard=1, speed 0.40 per device" in text
    assert "share 9% with shares='speed'" in text  # 40 / (200 + 200 + 40)
    assert "--calibrate" in format_node_groups(specs)
    why = "the calibration task failed there: ModuleNotFoundError: No module named 'ray_mesh'"
    text = format_node_groups(specs, {"a": 1.0, "b": 1.0, "c": why})
    assert f"group 2: node c, 1 worker(s), layout dp_shard=1, speed not measured ({why})" in text
    assert "speed 1.00 per device" in text and "busy or unreachable" not in text
