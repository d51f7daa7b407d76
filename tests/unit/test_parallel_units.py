"""ray_mesh.parallel without a process group: plan checks, stage layout, error messages."""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from ray_mesh.parallel import ParallelError
from ray_mesh.parallel.cp import cp_unsupported_reason
from ray_mesh.parallel.fsdp import find_blocks, mixed_precision_policy
from ray_mesh.parallel.pp.plan import PipelinePlan, known_hang, schedule_info
from ray_mesh.parallel.tp import make_style, validate_tp_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from _parallel_checks import load_example  # noqa: E402


class Net(nn.Module):
    def __init__(self, hidden: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, hidden)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"w1": nn.Linear(hidden, 2 * hidden), "w2": nn.Linear(2 * hidden, 6)})
            for _ in range(2))


# ----------------------------------------------------------------------------- TP plans
def test_plan_expands_patterns_and_builds_styles():
    plan = validate_tp_plan(Net(), {"layers.*.w1": "colwise", "layers.*.w2": "rowwise",
                                    "embed": "rowwise"}, tp=2)
    assert list(plan) == ["layers.0.w1", "layers.1.w1", "layers.0.w2", "layers.1.w2", "embed"]
    assert isinstance(plan["layers.1.w1"], ColwiseParallel)
    assert isinstance(plan["layers.0.w2"], RowwiseParallel)


@pytest.mark.parametrize("plan, tp, message", [
    ({"layers.*.w1": "colwise"}, 5,
     r"layer 'layers.0.w1' \(Linear\(12 -> 24\)\) is split by ColwiseParallel over its "
     r"out_features=24, which tp=5 does not divide. Use a tp that divides 24 \(1, 2, 3, 4, 6"),
    ({"layers.1.w2": "rowwise"}, 5, r"layer 'layers.1.w2' .*in_features=24"),
    ({"embed": "colwise"}, 5, r"layer 'embed' \(Embedding\(10, 12\)\).*embedding_dim=12"),
    ({"embed": "rowwise"}, 3, r"layer 'embed' .*num_embeddings=10, which tp=3"),
])
def test_indivisible_hidden_size_names_the_layer_and_the_fix(plan, tp, message):
    with pytest.raises(ParallelError, match=message):
        validate_tp_plan(Net(), plan, tp=tp)


def test_plan_typo_is_an_error_unless_not_strict():
    with pytest.raises(ParallelError, match=r"'layers.\*.w3' matches no submodule.*layers.0.w1"):
        validate_tp_plan(Net(), {"layers.*.w3": "colwise"}, tp=2)
    assert validate_tp_plan(Net(), {"layers.*.w3": "colwise"}, tp=2, strict=False) == {}


def test_bad_plan_values():
    with pytest.raises(ParallelError, match=r"Unknown tensor-parallel style 'diagonal'.*colwise"):
        validate_tp_plan(Net(), {"embed": "diagonal"}, tp=2)
    with pytest.raises(ParallelError, match="mapping of module path to style"):
        validate_tp_plan(Net(), ["embed"], tp=2)  # type: ignore[arg-type]
    with pytest.raises(ParallelError, match="tp must be a positive int"):
        validate_tp_plan(Net(), {}, tp=0)


def test_style_names():
    assert make_style("colwise_sp").input_layouts == (Shard(1),)
    assert make_style("rowwise_sp").output_layouts == (Shard(1),)
    assert isinstance(make_style("sequence"), SequenceParallel)
    style = RowwiseParallel()
    assert make_style(style) is style


def test_example_plans_fit_their_models():
    tf = load_example("fsdp_tp_transformer")
    for tp in (1, 2, 4):
        validate_tp_plan(tf.make_model(), tf.tp_plan(), tp)
    with pytest.raises(ParallelError, match=r"layer 'tok_embeddings'.*tp=3"):
        validate_tp_plan(tf.make_model(), tf.tp_plan(), 3)
    with pytest.raises(ParallelError, match="heads=4 do not split over tp=3"):
        tf.check_config(tf.DEFAULTS, 3)
    for name in ("tp_pp_mlp", "pp_hsdp_tp"):
        ex = load_example(name)
        assert len(validate_tp_plan(ex.make_model(), ex.TP_PLAN, 2)) == len(ex.TP_PLAN)


# ----------------------------------------------------------------------------- pipeline plans
def test_stage_layout_single_loop_and_v():
    plan = PipelinePlan(pp=2, num_layers=5, n_microbatches=4, schedule="1f1b")
    assert plan.layer_ranges() == [(0, 3), (3, 5)]
    assert plan.stages_of(0) == [0] and plan.stages_of(1) == [1]
    loop = PipelinePlan(pp=2, num_layers=8, n_microbatches=4, schedule="Interleaved1F1B")
    assert loop.stages_per_rank == 2 and loop.num_stages == 4
    assert loop.stages_of(0) == [0, 2] and loop.stages_of(1) == [1, 3]
    assert loop.layer_ranges() == [(0, 2), (2, 4), (4, 6), (6, 8)]
    v = PipelinePlan(pp=2, num_layers=4, n_microbatches=4, schedule="zbv")
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2]
    custom = PipelinePlan(pp=2, num_layers=5, n_microbatches=2, schedule="gpipe",
                          layers_per_stage=(1, 4))
    assert custom.layer_ranges() == [(0, 1), (1, 5)]


@pytest.mark.parametrize("kwargs, message", [
    ({"pp": 4, "num_layers": 3, "n_microbatches": 4},
     r"pp=4 x stages_per_rank=1 = 4 stages, but the model has only 3 layers.*Lower pp"),
    ({"pp": 2, "num_layers": 3, "n_microbatches": 4, "schedule": "interleaved_1f1b"},
     r"4 stages, but the model has only 3 layers"),
    ({"pp": 2, "num_layers": 4, "n_microbatches": 3, "batch_size": 32},
     r"n_microbatches=3 does not divide the batch of 32 .*\(1, 2, 4, 8, 16, 32\)"),
    ({"pp": 2, "num_layers": 4, "n_microbatches": 8, "batch_size": 4, "schedule": "gpipe"},
     r"n_microbatches=8 does not divide the batch of 4"),
    ({"pp": 4, "num_layers": 4, "n_microbatches": 2, "schedule": "1f1b"},
     r"1F1B needs at least as many microbatches as stages \(4\).*schedule='gpipe'"),
    ({"pp": 2, "num_layers": 4, "n_microbatches": 5, "schedule": "interleaved"},
     r"not a multiple of its 2 rounds"),
    ({"pp": 2, "num_layers": 8, "n_microbatches": 4, "schedule": "zbv", "stages_per_rank": 3},
     r"needs exactly 2 stages per rank"),
    ({"pp": 2, "num_layers": 8, "n_microbatches": 4, "schedule": "gpipe",
      "stages_per_rank": 2}, r"one stage per rank.*interleaved_1f1b"),
    ({"pp": 2, "num_layers": 4, "n_microbatches": 4, "schedule": "pipedream"},
     r"Unknown pipeline schedule 'pipedream'"),
    ({"pp": 2, "num_layers": 4, "n_microbatches": 4, "layers_per_stage": (1, 2)},
     r"sums to 3, but the model has 4 layers"),
    ({"pp": 0, "num_layers": 4, "n_microbatches": 4}, r"pp must be a positive int"),
])
def test_bad_pipeline_inputs(kwargs, message):
    with pytest.raises(ParallelError, match=message):
        PipelinePlan(**kwargs)


def test_schedule_names():
    assert schedule_info("ScheduleInterleaved1F1B") == ("Interleaved1F1B", "loop")
    assert schedule_info("interleaved-1f1b") == ("Interleaved1F1B", "loop")
    assert schedule_info("GPipe") == ("GPipe", "single")
    assert schedule_info("dualpipev") == ("DualPipeV", "v")
    for torch_name, _ in map(schedule_info, ("gpipe", "1f1b", "interleaved", "loopedbfs",
                                             "interleavedzb", "zbv", "dualpipev")):
        assert torch_schedules.get_schedule_class(torch_name) is not None


def test_known_hang_is_refused_before_it_runs(monkeypatch):
    # This torch has the fix (pytorch#152938): every schedule runs on gloo (see pp.py).
    assert hasattr(torch_schedules, "_wait_batch_p2p")
    assert known_hang("1f1b", "gloo") is None
    PipelinePlan(pp=2, num_layers=4, n_microbatches=4, schedule="1f1b", backend="gloo")
    # Without the fix, gloo + a batched-p2p schedule is refused; GPipe and NCCL are not.
    monkeypatch.delattr(torch_schedules, "_wait_batch_p2p")
    assert "deadlocks on the 'gloo' backend" in known_hang("interleaved_1f1b", "gloo")
    assert known_hang("gpipe", "gloo") is None
    assert known_hang("1f1b", "nccl") is None
    with pytest.raises(ParallelError, match=r"1F1B deadlocks.*Use schedule='gpipe'"):
        PipelinePlan(pp=2, num_layers=4, n_microbatches=4, schedule="1f1b", backend="gloo")


# ----------------------------------------------------------------------------- CP, FSDP options
def test_cp_support():
    assert cp_unsupported_reason("cuda", "nccl") is None
    assert cp_unsupported_reason("cuda", "cpu:gloo,cuda:nccl") is None
    for device, backend in (("cpu", "gloo"), ("cuda", "gloo")):
        reason = cp_unsupported_reason(device, backend)
        assert "needs CUDA GPUs with the NCCL backend" in reason and "Set cp: 1" in reason


def test_mixed_precision_names():
    assert mixed_precision_policy("bf16").param_dtype == torch.bfloat16
    assert mixed_precision_policy("bf16").reduce_dtype == torch.float32
    assert mixed_precision_policy(None).param_dtype is None
    with pytest.raises(ParallelError, match=r"Unknown mixed precision 'int8'.*bf16"):
        mixed_precision_policy("int8")


def test_find_blocks():
    net = Net()
    assert find_blocks(net) == list(net.layers)
    seq = nn.Sequential(OrderedDict(a=nn.Linear(2, 2), act=nn.ReLU(), b=nn.Linear(2, 2)))
    assert find_blocks(seq) == [seq.a, seq.b]
    assert find_blocks(net, "layers") == list(net.layers)
    assert find_blocks(net, lambda name, _: name == "embed") == [net.embed]
    with pytest.raises(ParallelError, match="has no submodule 'blocks'"):
        find_blocks(net, "blocks")
