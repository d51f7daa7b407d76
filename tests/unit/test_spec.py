"""Every rule of MeshSpec: sizes, inference, shorthands, serialisation, coordinates."""

from __future__ import annotations

import pytest

from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS, MeshSpec, MeshSpecError


def test_default_is_fsdp_over_everything():
    spec = MeshSpec().resolve(8)
    assert spec.to_dict() == {"pp": 1, "dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1}


def test_infers_the_one_open_dim():
    assert MeshSpec(dp_replicate=2, dp_shard=-1, tp=2).resolve(16).dp_shard == 4
    assert MeshSpec(pp=-1, dp_shard=2, tp=2).resolve(8).pp == 2


@pytest.mark.parametrize("value", [0, -2, -100])
def test_zero_and_negative_sizes_are_refused(value):
    with pytest.raises(MeshSpecError, match="not a dim size") as err:
        MeshSpec(tp=value)
    assert "positive" in str(err.value)


@pytest.mark.parametrize("value", [True, 2.0, "2", None])
def test_non_int_sizes_are_refused(value):
    with pytest.raises(MeshSpecError, match="tp="):
        MeshSpec(tp=value)


def test_two_inferred_dims_are_refused():
    with pytest.raises(MeshSpecError, match=r"Only one dim may be -1.*dp_replicate.*dp_shard"):
        MeshSpec(dp_replicate=-1, dp_shard=-1)


def test_product_must_match_world_size_and_says_how():
    with pytest.raises(MeshSpecError) as err:
        MeshSpec(dp_replicate=2, dp_shard=2, tp=2).resolve(4)
    msg = str(err.value)
    assert "= 8 ranks" in msg and "4 workers" in msg and "num_workers=8" in msg


def test_inferred_dim_must_divide():
    with pytest.raises(MeshSpecError, match=r"Cannot infer dp_shard: 6 workers.*multiple of 4"):
        MeshSpec(dp_shard=-1, tp=4).resolve(6)


def test_nodes_only_on_outer_dims():
    assert MeshSpec(dp_replicate="nodes").dp_replicate == "nodes"
    assert MeshSpec(pp="NODES", dp_shard=-1).pp == "nodes"
    with pytest.raises(MeshSpecError, match="only the outer dims"):
        MeshSpec(tp="nodes")


def test_nodes_needs_the_node_count():
    with pytest.raises(MeshSpecError, match="node count"):
        MeshSpec.hsdp().resolve(8)


def test_hsdp_shorthand_replicates_across_nodes():
    spec = MeshSpec.hsdp().resolve(8, num_nodes=2)
    assert (spec.dp_replicate, spec.dp_shard) == (2, 4)
    spec = MeshSpec.hsdp(tp=2).resolve(8, num_nodes=2)
    assert (spec.dp_replicate, spec.dp_shard, spec.tp) == (2, 2, 2)


def test_fsdp_and_ddp_shorthands():
    assert MeshSpec.fsdp().resolve(4).dp_shard == 4
    ddp = MeshSpec.ddp().resolve(4)
    assert (ddp.dp_replicate, ddp.dp_shard) == (4, 1)


def test_dict_round_trip_and_shorthand_strings():
    spec = MeshSpec(pp=2, dp_replicate=2, dp_shard=-1, tp=2)
    assert MeshSpec.from_dict(spec.to_dict()) == spec
    assert MeshSpec.from_dict("hsdp") == MeshSpec.hsdp()
    assert MeshSpec.from_dict({"layout": "hsdp", "tp": 2}) == MeshSpec.hsdp(tp=2)
    assert MeshSpec.from_dict(None) == MeshSpec()


def test_unknown_dim_name_suggests_the_right_one():
    with pytest.raises(MeshSpecError, match=r"Unknown mesh dim 'dp_shards'.*'dp_shard'"):
        MeshSpec.from_dict({"dp_shards": 2})


def test_unknown_layout_and_conflicting_layout_keys():
    with pytest.raises(MeshSpecError, match="Unknown mesh layout 'zero3'"):
        MeshSpec.from_dict("zero3")
    with pytest.raises(MeshSpecError, match="sets dp_replicate and dp_shard itself"):
        MeshSpec.from_dict({"layout": "hsdp", "dp_shard": 2})


def test_yaml_text_file_and_top_level_mesh_key(tmp_path):
    assert MeshSpec.from_yaml("dp_replicate: 2\ndp_shard: -1\n") == MeshSpec(dp_replicate=2)
    path = tmp_path / "m.yaml"
    path.write_text("mesh:\n  tp: 2\n  dp_shard: -1\n")
    assert MeshSpec.from_yaml(path) == MeshSpec(tp=2)


def test_yaml_parse_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("dp_replicate: 2\ndp_shard: [1, 2\ntp: 1\n")
    with pytest.raises(MeshSpecError, match=r"bad.yaml is not valid YAML at line \d+"):
        MeshSpec.from_yaml(path)


def test_yaml_unknown_key_and_missing_file(tmp_path):
    with pytest.raises(MeshSpecError, match="Unknown mesh dim 'pipeline'"):
        MeshSpec.from_yaml("pipeline: 2\n")
    with pytest.raises(MeshSpecError, match="does not exist"):
        MeshSpec.from_yaml(tmp_path / "nope.yaml")


def test_coordinates_are_row_major_and_flattened_dims_compose():
    spec = MeshSpec(pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2).resolve(16)
    seen = set()
    for rank in range(16):
        c = spec.coordinate(rank)
        flat = 0
        for name in DIM_NAMES:
            flat = flat * spec.size(name) + c[name]
        assert flat == rank
        assert c["dp"] == c["dp_replicate"] * 2 + c["dp_shard"]
        assert c["dp_cp"] == c["dp"]  # cp == 1
        seen.add(tuple(c[n] for n in DIM_NAMES))
    assert len(seen) == 16
    assert {f: spec.size(f) for f in FLATTENED_DIMS} == {"dp": 4, "dp_shard_cp": 2, "dp_cp": 4}


def test_unresolved_spec_refuses_queries():
    with pytest.raises(MeshSpecError, match=r"resolve\(world_size"):
        _ = MeshSpec().world_size
    with pytest.raises(MeshSpecError, match="Unknown mesh dim"):
        MeshSpec(dp_shard=2).size("ep")
