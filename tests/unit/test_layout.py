"""One Layout, one parser, one printer: round trips, bad strings named with the fix, and
every consumer (CLI, job file, MeshConfig, planner output, status page, benchmark keys)
reading and writing the same spelling."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from ray_mesh.core.layout import (
    FAMILIES,
    DiLoCoConfig,
    Layout,
    check_family,
    family_mesh,
    parse_layout,
    parse_replicate,
)
from ray_mesh.core.spec import MeshSpec
from ray_mesh.errors import LayoutError, UserInputError

ROOT = Path(__file__).resolve().parents[2]

MESHES = [{"dp_shard": 1}, {"dp_shard": 4}, {"dp_replicate": 2, "dp_shard": 2},
          {"pp": 2, "tp": 4}, {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2},
          {"dp_replicate": "nodes", "dp_shard": -1}, {"pp": -1, "tp": 2}]
DILOCOS = [None, DiLoCoConfig(), DiLoCoConfig(every=8, compress="int8", streaming=2,
                                              outer_lr=0.5, nesterov=False, overlap=1)]
PIPES = [(None, 1), ("1f1b", 8), ("interleaved1f1b", 4), (None, 2)]


@pytest.mark.parametrize("mesh, reduce, pipe, diloco",
                         list(itertools.product(MESHES, ("fp32", "bf16"), PIPES, DILOCOS)))
def test_parse_of_print_is_the_layout(mesh, reduce, pipe, diloco):
    if diloco is not None and mesh.get("dp_replicate", 1) == 1:  # no replicas to average
        with pytest.raises(LayoutError, match="dp_replicate=1"):
            Layout.of(mesh, reduce=reduce, schedule=pipe[0], microbatches=pipe[1],
                      diloco=diloco)
        return
    lay = Layout.of(mesh, reduce=reduce, schedule=pipe[0], microbatches=pipe[1], diloco=diloco)
    text = str(lay)
    assert parse_layout(text) == lay, text
    assert str(parse_layout(text)) == text  # one printing of each layout
    assert parse_layout(lay.to_dict()) == lay
    assert parse_layout(json.loads(json.dumps(lay.to_dict()))) == lay  # as JSON carries it
    assert hash(parse_layout(text)) == hash(lay)  # frozen: a dict key, a set member


def test_the_canonical_strings_read_as_documented():
    assert str(Layout.of({"dp_replicate": 2, "dp_shard": 4}, reduce="bf16")) == \
        "dp_replicate=2,dp_shard=4/bf16/sync"
    assert str(Layout.of({"pp": 2, "tp": 4}, schedule="1F1B", microbatches=8)) == \
        "pp=2,tp=4/fp32/schedule=1f1b,microbatches=8/sync"
    lay = parse_layout("dp_replicate=nodes,dp_shard=-1/fp32/diloco:every=50,compress=int8")
    assert lay.mesh == MeshSpec.hsdp() and lay.diloco == DiLoCoConfig(compress="int8")
    assert lay.replicate == "diloco" and lay.family == "hsdp"
    # segments after the dims in any order, left out: fp32, no pipeline, sync
    assert parse_layout("tp=2/sync/bf16") == Layout.of({"tp": 2}, reduce="bf16")
    assert parse_layout("dp_shard=4") == Layout.of({"dp_shard": 4})
    # a schedule in any common spelling is printed one way
    assert parse_layout("pp=2/schedule=Interleaved_1F1B").schedule == "interleaved1f1b"
    assert lay.resolved(8, 2).mesh == MeshSpec(dp_replicate=2, dp_shard=4)


@pytest.mark.parametrize("text, words", [
    ("", ["not a layout", "dp_replicate=2,dp_shard=4/bf16/sync"]),
    ("dp=2/fp32", ["'dp=2' is not a dim", "pp, dp_replicate, dp_shard, cp, tp"]),
    ("tp=0/fp32", ["tp=0 is not a dim size"]),
    ("tp=two", ["'tp=two' is not a dim"]),
    ("tp=2,tp=4", ["dim tp given twice"]),
    ("dp_shard=nodes", ["dp_shard='nodes' is not allowed"]),
    ("tp=2/fp16", ["segment 'fp16'", "fp32, bf16"]),
    ("tp=2/fp32/bf16", ["two reduce segments"]),
    ("pp=2/schedule=zigzag", ["Unknown pipeline schedule 'zigzag'", "gpipe, 1f1b"]),
    ("pp=2/microbatches=0", ["microbatches=0", "integer >= 1"]),
    ("pp=2/microbatches=many", ["microbatches='many' is not an integer"]),
    ("pp=2/schedule=1f1b,chunks=2", ["pipeline key(s) ['chunks']"]),
    ("dp_replicate=2/fp32/diloco:evry=5", ["unknown key(s) ['evry']", "every"]),
    ("dp_replicate=2/fp32/diloco:every=0", ["replicate.every=0"]),
    ("dp_replicate=2/fp32/diloco:nesterov=maybe", ["nesterov='maybe'", "bool"]),
    ("dp_replicate=2/fp32/dilocos", ["replicate 'dilocos'", "diloco:every=50"]),
    # the spellings before the Layout type name the new one
    ("tp-pp", ["layout family (tp_pp)", "--layout tp_pp"]),
    ("tp_hsdp+bf16", ["layout family (tp_hsdp)", "plan.layouts"]),
    ("tp2_hsdp+bf16+diloco50/int8", ["layout family (tp_hsdp)"]),
    ("hsdp", ["layout family (hsdp)", "dp_replicate=2,dp_shard=4/bf16/sync"]),
    ("tp2/bf16/mb2@alone", ["is not a layout", "dims/reduce/replicate"]),
])
def test_bad_strings_name_the_problem_and_the_fix(text, words):
    with pytest.raises(LayoutError) as info:
        parse_layout(text)
    assert isinstance(info.value, UserInputError)  # one line and exit 2 in the CLI
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("value, words", [
    ({"mesh": {"tp": 2}, "dtype": "bf16"}, ["unknown key(s) ['dtype']", "reduce"]),
    ({"mesh": {"tpp": 2}}, ["tpp"]),
    ({"mesh": {"pp": 2}, "pipeline": {"stages": 2}}, ["layout.pipeline", "schedule"]),
    ({"replicate": {"mode": "async"}}, ["replicate.mode='async'", "sync"]),
    ({"replicate": {"mode": "sync", "every": 5}}, ["only apply to mode: diloco"]),
    (5, ["not int"]),
])
def test_bad_mappings_name_the_key(value, words):
    with pytest.raises(LayoutError) as info:
        parse_layout(value)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_families_are_read_off_the_dims_and_refuse_old_spellings():
    for fam in FAMILIES:
        dims = family_mesh(fam, 2, 4)
        assert Layout(dims).family == fam, (fam, dims)
    assert check_family("tp_pp") == "tp_pp"
    with pytest.raises(LayoutError, match="'tp-dp' is now spelled 'tp_hsdp'"):
        check_family("tp-dp")
    with pytest.raises(LayoutError, match="unknown layout family 'zigzag'"):
        check_family("zigzag")
    with pytest.raises(LayoutError, match="tp=3 does not divide the 4 workers"):
        family_mesh("tp_hsdp", 2, 4, tp=3)
    assert parse_replicate("diloco") == DiLoCoConfig() and parse_replicate("sync") is None


# ----------------------------------------------------------------------------- consumers
def test_job_file_takes_the_layout_in_one_key_or_from_mesh_and_replicate():
    from ray_mesh.cli.job import Job, JobError
    from ray_mesh.cli.runner import mesh_config

    text = "dp_replicate=2,dp_shard=2/bf16/diloco:every=10,compress=int8"
    job = Job.from_dict({"train": "x.py:f", "layout": text})
    assert job.layout == parse_layout(text) and str(job.layout) == text
    assert job.mesh == MeshSpec(dp_replicate=2, dp_shard=2)
    assert job.replicate == DiLoCoConfig(every=10, compress="int8")
    cfg = mesh_config(job)  # what `ray-mesh run` hands Ray Train
    assert cfg.layout == job.layout and cfg.to_dict()["layout"] == text
    # the mapping form of the same layout, as YAML gives it
    mapping = {"mesh": {"dp_replicate": 2, "dp_shard": 2}, "reduce": "bf16",
               "replicate": {"mode": "diloco", "every": 10, "compress": "int8"}}
    assert Job.from_dict({"train": "x.py:f", "layout": mapping}).layout == job.layout
    # mesh: and replicate: make the same Layout (fp32 reduce: they cannot say bf16)
    old = Job.from_dict({"train": "x.py:f", "mesh": {"dp_replicate": 2, "dp_shard": 2},
                         "replicate": {"mode": "diloco", "every": 10, "compress": "int8"}})
    assert str(old.layout) == "dp_replicate=2,dp_shard=2/fp32/diloco:every=10,compress=int8"
    with pytest.raises(JobError, match="remove mesh and replicate"):
        Job.from_dict({"train": "x.py:f", "layout": text, "mesh": "hsdp", "replicate": "sync"})
    with pytest.raises(JobError, match="layout: 'tp-pp' names a layout family"):
        Job.from_dict({"train": "x.py:f", "layout": "tp-pp"})
    with pytest.raises(JobError, match="dp_replicate=1"):  # DiLoCo needs replicas
        Job.from_dict({"train": "x.py:f", "layout": "dp_shard=4/fp32/diloco"})


def test_workers_get_every_option_whole_and_the_mesh_in_the_layout():
    """MeshConfig's options reach a worker as one MeshOptions (raytrain.worker_setup), every
    option as given but the mesh, which the worker gets resolved in its layout."""
    from dataclasses import fields

    from ray_mesh.core.options import MeshOptions
    from ray_mesh.raytrain.backend import MeshConfig

    cfg = MeshConfig(mesh="fsdp", hang_timeout_s=7.0, wait_sample_s=None, verbose=True,
                     worker_niceness=None, link_probe_s=2.0)
    got = cfg.worker_options()
    assert type(got) is MeshOptions and got.mesh is None
    for f in fields(MeshOptions):
        if f.name != "mesh":
            assert getattr(got, f.name) == getattr(cfg, f.name), f.name


def test_meshconfig_takes_a_layout_and_holds_the_one_it_runs():
    from ray_mesh.raytrain.backend import MeshConfig

    cfg = MeshConfig(layout="dp_replicate=nodes,dp_shard=-1/bf16/sync")
    assert cfg.mesh == MeshSpec.hsdp() and cfg.replicate is None
    assert cfg.layout.reduce == "bf16"
    assert MeshConfig(mesh="fsdp").layout == Layout(MeshSpec.fsdp())
    assert MeshConfig(mesh="auto", plan=_plan()).layout is None  # picked at bring-up
    with pytest.raises(ValueError, match="not both"):
        MeshConfig(layout="dp_shard=4/fp32/sync", mesh="fsdp")
    with pytest.raises(LayoutError):
        MeshConfig(layout="dp_shard=4/fp17/sync")


def test_meshconfig_is_a_layout_and_options_and_replace_keeps_both():
    """MeshConfig(layout=..., options=...) is a run's settings in two objects; the options
    are read at construction, so dataclasses.replace of a built config (mesh, replicate and
    layout all set, options not a field) builds the same run."""
    import dataclasses

    from ray_mesh import MeshOptions
    from ray_mesh.raytrain.backend import MeshConfig

    opts = MeshOptions(interface="wg0", hang_timeout_s=None, link_probe_s=2.0)
    cfg = MeshConfig(layout="dp_replicate=nodes,dp_shard=2/bf16/diloco:every=8", options=opts)
    assert (cfg.interface, cfg.hang_timeout_s, cfg.link_probe_s) == ("wg0", None, 2.0)
    assert cfg.worker_options() == opts
    again = dataclasses.replace(cfg, total_steps=7)
    assert again.layout == cfg.layout and again.layout.reduce == "bf16"
    assert again.worker_options() == opts and again.total_steps == 7
    with pytest.raises(ValueError, match="interface given beside options="):
        MeshConfig(options=opts, interface="eth0")
    with pytest.raises(ValueError, match="options.mesh is set"):
        MeshConfig(options=MeshOptions(mesh="fsdp"))
    with pytest.raises(ValueError, match="must be a ray_mesh.MeshOptions"):
        MeshConfig(options={"interface": "wg0"})
    with pytest.raises(ValueError, match="link_probe_s"):
        MeshConfig(options=MeshOptions(link_probe_s=99))
    with pytest.raises(ValueError, match="not both"):  # a different mesh is still refused
        dataclasses.replace(cfg, mesh={"dp_replicate": 2, "dp_shard": 4})


def test_a_layout_with_diloco_has_replicates_to_average():
    """DiLoCo needs dp_replicate >= 2 ('nodes' or -1 until sized): a rule of the Layout
    itself, so no spelling (string, mapping, Layout.of, MeshConfig, job) builds one
    without, and reading a job needs no torch to say so."""
    from ray_mesh.core.diloco_config import DiLoCoConfig
    from ray_mesh.raytrain.backend import MeshConfig

    for text in ("dp_shard=4/fp32/diloco", "dp_replicate=1,dp_shard=2/fp32/diloco:every=5"):
        with pytest.raises(LayoutError, match="dp_replicate=1: set mesh.dp_replicate: nodes"):
            parse_layout(text)
    with pytest.raises(LayoutError, match="dp_replicate=1"):
        Layout.of({"dp_shard": 4}, diloco=DiLoCoConfig())
    with pytest.raises(LayoutError, match="dp_replicate=1"):
        MeshConfig(mesh={"dp_shard": 4}, replicate={"mode": "diloco"})
    for ok in ("dp_replicate=nodes,dp_shard=-1/fp32/diloco:every=5",
               "dp_replicate=-1,dp_shard=2/fp32/diloco:every=5",
               "dp_replicate=2,dp_shard=2/bf16/diloco:every=5"):
        assert str(parse_layout(ok)) == ok


def _plan():
    from ray_mesh.planning.inputs import PlanInputs

    return PlanInputs.from_dict({"model": {"params": 10_000, "layers": 2, "hidden": 16,
                                           "heads": 2}, "tokens_per_step": 64,
                                 "compute_s": 1.0}, load_factory=lambda ref: None)


def test_planner_proposals_are_layouts_and_print_as_such():
    from ray_mesh.planning.cost import Links, format_ranked

    plan = _plan()
    ranked = plan.rank(Links(2, 2, 20.0))
    for p in ranked:
        data = p.to_json()
        assert parse_layout(data["layout"]) == p.layout
        assert data["family"] == p.layout.family
    table = format_ranked(ranked)
    assert all(str(p.layout) in table for p in ranked)


def test_status_reads_the_layout_a_run_saved_with_the_one_parser():
    from ray_mesh.core.topology import WorkerReport, plan_mesh
    from ray_mesh.errors import Malformed
    from ray_mesh.observability.layout import layout_document, to_markdown
    from ray_mesh.observability.status_input import parse_layout as parse_saved

    lay = parse_layout("dp_replicate=2,dp_shard=2/bf16/sync")
    workers = [WorkerReport(rank=r, node_id=f"n{r // 2}", node_ip=f"10.0.0.{r // 2}")
               for r in range(4)]
    doc = layout_document(plan_mesh(lay.mesh, workers), layout=lay)
    assert doc["layout"] == str(lay) and str(lay) in to_markdown(doc)
    assert parse_saved(json.dumps(doc).encode(), "f")["layout"] == str(lay)
    # a layout the cluster wrote in another spelling is read, and shown canonically
    doc["layout"] = "dp_shard=2,dp_replicate=2/sync/bf16"
    assert parse_saved(json.dumps(doc).encode(), "f")["layout"] == str(lay)
    doc["layout"] = "hsdp+bf16"
    with pytest.raises(Malformed, match="layout"):
        parse_saved(json.dumps(doc).encode(), "f")


def test_benchmark_results_are_keyed_by_the_layout_string():
    """The slow-links section of results.json names each layout as the planner prints it."""
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    sections = [s for s in (results.get("slowlinks") or {}).values()
                if isinstance(s, dict) and "pick" in s]
    assert sections, "results.json has no slowlinks section"
    for sec in sections:
        keys = [k for k, v in sec.items() if isinstance(v, dict) and "measured_step_s" in v]
        assert keys
        for key in (*keys, sec["pick"], sec["fastest"], sec["analytic_pick"]):
            assert str(parse_layout(key)) == key, key
        for trial in sec["trial"]["layouts"]:
            assert str(parse_layout(trial["layout"])) == trial["layout"]


def test_the_pipeline_stage_plan_is_made_from_a_layout():
    from ray_mesh.errors import ParallelError
    from ray_mesh.parallel.pp import PipelinePlan

    plan = PipelinePlan.from_layout(parse_layout("pp=2,tp=2/fp32/schedule=gpipe,microbatches=4"),
                                    num_layers=4)
    assert (plan.pp, plan.schedule, plan.n_microbatches) == (2, "gpipe", 4)
    with pytest.raises(ParallelError, match="not sized yet"):
        PipelinePlan.from_layout(parse_layout("pp=-1,tp=2"), num_layers=4)
