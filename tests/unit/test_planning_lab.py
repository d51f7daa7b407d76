"""The calibrated step-time model of the benchmarks' laboratory (``benchmarks/planning_lab``):
it adds up its measured parts, and its GPipe schedule runs as worked out by hand.

Split from tests/unit/test_plan_pick.py when the laboratory left the package; the product's
cost model and pick stay tested there.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.planning_lab.calibrate import (
    Calibration,
    accumulation,
    gpipe_s,
    local_key,
    local_shapes,
    pipeline_efficiency,
    predict_calibrated,
    unit_key,
)
from ray_mesh.core.layout import Layout
from ray_mesh.planning.cost import Links, ModelStats, PlanError, Workload, predict

STATS = ModelStats(params=10_000_000, layers=4, hidden=256, heads=4)
WORK = Workload(tokens=4096, compute_s=4.0)


CAL = Calibration(collective_s=0.001, gloo_Bps=200e6, p2p_s=0.002,
                  local_s={"fsdp/fp32": 0.3, "fsdp/bf16": 0.25, "tp2/fp32": 0.6})


def test_calibrated_prediction_is_local_step_plus_modelled_communication():
    links = Links(2, 2, 100.0)
    hsdp = Layout.of({"dp_replicate": 2, "dp_shard": 2})
    got = predict_calibrated(hsdp, STATS, links, WORK, CAL)
    base = predict(hsdp, STATS, links, WORK)
    # the shard's all-reduce over 2 replicas: one rank moves its shard (half of 40 MB)
    volume = STATS.params * 4 / 2
    calls = 1 + STATS.layers + 1
    assert got.step_s == pytest.approx(0.3 + base.cross_s + volume / 200e6 + calls * 0.001)
    assert got.cross_node_bytes_per_step == base.cross_node_bytes_per_step
    ddp = predict_calibrated(Layout.of({"dp_replicate": 4}), STATS, links, WORK, CAL)
    assert ddp.compute_s == pytest.approx(WORK.compute_s / 4)  # arithmetic only
    measured = Calibration(0.001, 200e6, 0.002, {"none/fp32": 0.2, "tp2/fp32/mb2": 0.6,
                                                  "none/fp32/mb2": 0.3, "fsdp/fp32": 0.5})
    ddp = predict_calibrated(Layout.of({"dp_replicate": 4}), STATS, links, WORK, measured)
    assert ddp.compute_s == pytest.approx(0.2)
    tp_pp = predict_calibrated(Layout.of({"pp": 2, "tp": 2}), STATS, links, WORK, measured)
    assert tp_pp.compute_s == pytest.approx(0.6 * 5 / 4 + 2 * 4 * 0.002)
    # the link a microbatch's activations cross (wire + gloo's CPU bytes), as a pipeline stage
    boundary = WORK.tokens * STATS.hidden * 4 / 4
    link = boundary * 8 / 100e6 + boundary / 200e6 + links.latency_s
    # tp_pp: the node's ranks are one pipeline, so a link waits for its receiver's recv
    assert tp_pp.step_s - tp_pp.compute_s == pytest.approx(
        gpipe_s(0.05, 0.1, link, 4, 2, rendezvous=True) - gpipe_s(0.05, 0.1, 0, 4, 2) + 0.001)
    pp = predict_calibrated(Layout.of({"pp": 2, "dp_shard": 2}), STATS, links, WORK,
                            measured)
    # the arithmetic in 2 chunks x bubble + half of FSDP's overhead + the sends
    assert pp.compute_s == pytest.approx(0.3 * 5 / 4 + (0.5 - 0.2) / 2 + 2 * 4 * 0.002)
    # the pipeline run inside a node, measured: its schedule's cost replaces the bubble
    # (here 0.9 / (0.3 x 5/4): stages sharing cores fill part of it) and the in-node sends
    in_node = Calibration(0.001, 200e6, 0.002, {**measured.local_s, "pp2/fp32/mb4": 0.45})
    assert pipeline_efficiency(in_node, 2, 4) == pytest.approx(0.45 / (0.3 * 5 / 4))
    pp = predict_calibrated(Layout.of({"pp": 2, "dp_shard": 2}), STATS, links, WORK,
                            in_node)
    assert pp.compute_s == pytest.approx(0.45 + (0.5 - 0.2) / 2)
    tp_pp = predict_calibrated(Layout.of({"pp": 2, "tp": 2}), STATS, links, WORK,
                               in_node)
    assert tp_pp.compute_s == pytest.approx(0.6 * 5 / 4 * 0.45 / (0.3 * 5 / 4))
    # tp_hsdp: TP's local shape + FSDP's overhead (its local step less the arithmetic)
    tp_cal = Calibration(0.001, 200e6, 0.002, {"none/fp32": 0.2, "fsdp/fp32": 0.5,
                                               "tp2/fp32": 0.6})
    tp_hsdp = predict_calibrated(Layout.of({"dp_replicate": 2, "dp_shard": 1, "tp": 2}),
                                 STATS, links, WORK, tp_cal)
    assert tp_hsdp.compute_s == pytest.approx(0.6 + (0.5 - 0.2))
    # slower links only add wire time
    slow = predict_calibrated(hsdp, STATS, Links(2, 2, 20.0), WORK, CAL)
    assert slow.step_s - got.step_s == pytest.approx(
        predict(hsdp, STATS, Links(2, 2, 20.0), WORK).cross_s - base.cross_s)


def test_calibrated_prediction_prices_the_link_as_measure_cross_saw_it():
    links = Links(2, 2, 100.0)
    cal = Calibration(0.001, 200e6, 0.002, CAL.local_s, cross_call_s=0.004, cross_Bps=5e6)
    hsdp = Layout.of({"dp_replicate": 2, "dp_shard": 2})
    base = predict(hsdp, STATS, links, WORK)
    calls = 1 + STATS.layers + 1  # the loss mean + one replicate all-reduce per block
    assert predict_calibrated(hsdp, STATS, links, WORK, cal).step_s == pytest.approx(
        0.3 + base.cross_node_bytes_per_step / 2 / 5e6 + calls * 0.004)
    fsdp = Layout.of({"dp_shard": 4})
    fbase = predict(fsdp, STATS, links, WORK)
    # flat FSDP: every block's 2 all-gathers and reduce-scatter pay the cross call's extra
    extra = 3 * (STATS.layers + 1) * (0.004 - 0.001)
    assert predict_calibrated(fsdp, STATS, links, WORK, cal).step_s == pytest.approx(
        0.3 + fbase.cross_node_bytes_per_step / 2 / 5e6 + 0.004 + extra)
    # one node: nothing crosses, the measured link is not used
    one = predict_calibrated(hsdp, STATS, Links(1, 4, 100.0), WORK, cal)
    assert one.step_s == pytest.approx(predict_calibrated(hsdp, STATS, Links(1, 4, 100.0),
                                                          WORK, CAL).step_s)
    with pytest.raises(PlanError, match="cross_Bps"):
        Calibration(0.001, 1e6, 0.0, cross_Bps=-1.0)


def test_gpipe_schedule_by_hand():
    # no link: the bubble, (microbatches + pp - 1) x (forward + backward)
    assert gpipe_s(1, 2, 0, 4, 2) == pytest.approx(15)
    assert gpipe_s(1, 2, 0, 4, 3) == pytest.approx(18)
    assert gpipe_s(1, 2, 0, 1, 1) == pytest.approx(3)
    # a link (3 s) slower than the stages: forward, stage 0 ends microbatches at 1..4, the
    # link carries them 1-4, 4-7, 7-10, 10-13, stage 1 ends its forwards at 14; backward,
    # stage 1 at 16, 18, 20, 22, the link back 16-19, 19-22, 22-25, 25-28, stage 0 ends at 30
    assert gpipe_s(1, 2, 3, 4, 2) == pytest.approx(30)
    # a link faster than the stages adds its time once per direction (fill and drain)
    assert gpipe_s(1, 2, 0.5, 4, 2) == pytest.approx(15 + 2 * 0.5)
    # rendezvous: the link starts a microbatch only once the receiver is done with the one
    # before (it posts its recv then): forward 1 + 4 x (3 + 1) = 17 (stage 1 ends at 5, 9,
    # 13, 17); backward stage 1 ends at 19, then 4 x (link 3 + stage 0's 2) -> 39
    assert gpipe_s(1, 2, 3, 4, 2, rendezvous=True) == pytest.approx(39)
    # no link, or one stage: nothing to wait for
    assert gpipe_s(1, 2, 0, 4, 2, rendezvous=True) == pytest.approx(15)
    assert gpipe_s(1, 2, 3, 4, 1, rendezvous=True) == pytest.approx(12)
    with pytest.raises(PlanError, match="microbatches"):
        gpipe_s(1, 2, 0, 0, 2)
    with pytest.raises(PlanError, match="link -1"):
        gpipe_s(1, 2, -1, 4, 2)


def test_tp_pp_bubble_from_its_stage_alone_and_busy():
    # a stage computing alone runs at half its busy time. pp=2, 4 microbatches, no link:
    # 5 slots per direction, the first and last with one stage busy -> (0.5 + 3 + 0.5) / 5
    assert gpipe_s(1, 2, 0, 4, 2, alone=0.5) == pytest.approx(15 * (0.5 + 3 + 0.5) / 5)
    assert gpipe_s(1, 2, 0, 4, 3, alone=1.0) == pytest.approx(18)  # own devices
    # pp=3: slots busy 1, 2, 3, 3, 2, 1 -> 0.5, 0.75, 1, 1, 0.75, 0.5 of 6 x 3 s
    assert gpipe_s(1, 2, 0, 4, 3, alone=0.5) == pytest.approx(18 * 4.5 / 6)
    # a slow link taken in turns (rendezvous): every stage op then runs alone. Forward:
    # stage 0 at 0.5 per microbatch while stage 1 waits (done at 2.0); stage 1 takes turns
    # with the link, 3 + 0.5 each -> 0.5 + 4 x 3.5 = 14.5. Backward: stage 1 alone, 1 each
    # (15.5 .. 18.5), the link carries microbatch 0 over 15.5-18.5, stage 0 runs it to
    # 19.5, then 3 more turns of link 3 + stage 0's 1 -> 31.5
    assert gpipe_s(1, 2, 3, 4, 2, rendezvous=True, alone=0.5) == pytest.approx(31.5)
    with pytest.raises(PlanError, match="alone"):
        gpipe_s(1, 2, 0, 4, 2, alone=0.0)
    links = Links(2, 2, 100.0)
    cal = Calibration(0.001, 200e6, 0.002, {"tp2/fp32/mb2": 0.6, "tp2/fp32/mb2@alone": 0.3,
                                            "none/fp32/mb2": 0.3, "pp2/fp32/mb4": 0.45})
    tp_pp = predict_calibrated(Layout.of({"pp": 2, "tp": 2}), STATS, links, WORK, cal)
    # its own alone/busy speeds (0.8), not the non-TP pipeline's efficiency (1.2)
    assert tp_pp.compute_s == pytest.approx(0.6 * 5 / 4 * 0.8)


def test_world_collectives_priced_by_the_ring_measurement():
    links = Links(2, 2, 20.0)
    ring = Calibration(0.001, 200e6, 0.002, CAL.local_s, cross_call_s=0.004, cross_Bps=5e6,
                       ring_Bps=4e6, ring_call_s=0.05)
    ddp = Layout.of({"dp_replicate": 4})
    base = predict(ddp, STATS, links, WORK)
    got = predict_calibrated(ddp, STATS, links, WORK, ring)
    # the ring's bytes at its rate, every call (loss mean + DDP's buckets) at its fixed cost
    buckets = -(-STATS.params * 4 // 25_000_000)
    assert got.step_s - got.compute_s == pytest.approx(
        base.cross_node_bytes_per_step / 2 / 4e6 + (1 + buckets) * 0.05)
    fsdp = Layout.of({"dp_shard": 4})
    fbase = predict(fsdp, STATS, links, WORK)
    blocks = STATS.layers + 1  # the local shape paid each collective's in-node cost
    assert predict_calibrated(fsdp, STATS, links, WORK, ring).step_s == pytest.approx(
        0.3 + fbase.cross_node_bytes_per_step / 2 / 4e6 + 0.05
        + 3 * blocks * (0.05 - 0.001))
    # hsdp's replicate groups keep the per-group figure
    hsdp = Layout.of({"dp_replicate": 2, "dp_shard": 2})
    assert predict_calibrated(hsdp, STATS, links, WORK, ring).step_s == pytest.approx(
        predict_calibrated(hsdp, STATS, links, WORK, replace(ring, ring_Bps=0.0)).step_s)
    with pytest.raises(PlanError, match="ring_Bps"):
        replace(ring, ring_Bps=-1.0)
    with pytest.raises(PlanError, match="ring_call_s"):
        replace(ring, ring_call_s=60.0)


def test_in_node_fsdp_calls_and_pipeline_sends_priced_as_measured():
    links = Links(2, 2, 20.0)
    units = {unit_key("ag"): 0.005, unit_key("rs"): 0.01, unit_key("rs", "bf16"): 0.006}
    ring = Calibration(0.001, 200e6, 0.002, {"none/fp32": 0.2, "fsdp/fp32": 0.5,
                                             "fsdp/bf16": 0.45, "tp2/fp32": 0.6,
                                             "tp2/bf16": 0.55},
                       cross_call_s=0.004, cross_Bps=5e6, ring_Bps=4e6, ring_call_s=0.05)
    cal = replace(ring, unit_s=units)
    blocks = STATS.layers + 1
    # one unit over a node: two all-gathers (forward, backward) and a reduce-scatter
    assert cal.node_unit_s("fp32") == pytest.approx(2 * 0.005 + 0.01)
    assert cal.node_unit_s("bf16") == pytest.approx(2 * 0.005 + 0.006)
    assert ring.node_unit_s("fp32") is None
    # tp_hsdp (dp_shard 1) runs FSDP's hooks and copies but not its in-node collectives:
    # FSDP's overhead is its local step less the arithmetic less those calls
    tp_hsdp = Layout.of({"dp_replicate": 2, "dp_shard": 1, "tp": 2})
    assert predict_calibrated(tp_hsdp, STATS, links, WORK, cal).compute_s == pytest.approx(
        0.6 + 0.5 - 0.2 - blocks * 0.02)
    assert predict_calibrated(tp_hsdp, STATS, links, WORK, ring).compute_s == pytest.approx(
        0.6 + 0.5 - 0.2)
    bf16 = Layout.of(tp_hsdp.mesh, reduce="bf16")
    assert predict_calibrated(bf16, STATS, links, WORK, cal).compute_s == pytest.approx(
        0.55 + 0.45 - 0.2 - blocks * 0.016)
    # the layouts that shard inside the node run those calls: unchanged
    for lay in (Layout.of({"dp_shard": 4}), Layout.of({"dp_replicate": 2,
                                                                 "dp_shard": 2})):
        assert predict_calibrated(lay, STATS, links, WORK, cal).step_s == pytest.approx(
            predict_calibrated(lay, STATS, links, WORK, ring).step_s)
    # a pipeline's link stage is the measured one-way send of a microbatch
    staged = Calibration(0.001, 200e6, 0.002, {"none/fp32/mb2": 0.3, "fsdp/fp32": 0.5,
                                               "none/fp32": 0.2}, cross_call_s=0.004,
                         cross_Bps=5e6, send_s=0.07)
    pp = predict_calibrated(Layout.of({"pp": 2, "dp_shard": 2}), STATS, links, WORK, staged)
    stage = 0.3 / 4
    # two pipelines per node: each waits for its receiver, alone on the link at twice the
    # shared rate; both together no faster than the link (+ the loss mean across nodes)
    fwd, bwd = stage / 3, 2 * stage / 3
    assert pp.step_s - pp.compute_s == pytest.approx(
        max(gpipe_s(fwd, bwd, 0.035, 4, 2, rendezvous=True), gpipe_s(fwd, bwd, 0.07, 4, 2))
        - gpipe_s(fwd, bwd, 0, 4, 2) + 0.004)
    # one rank per node: that rank's one pipeline receives in turn with its compute
    one = predict_calibrated(Layout.of({"pp": 2}), STATS, Links(2, 1, 20.0), WORK, staged)
    assert one.step_s - one.compute_s == pytest.approx(
        gpipe_s(fwd, bwd, 0.07, 4, 2, rendezvous=True) - gpipe_s(fwd, bwd, 0, 4, 2) + 0.004)
    with pytest.raises(PlanError, match="send_s"):
        replace(staged, send_s=-0.1)
    with pytest.raises(PlanError, match="ag/fp32"):
        replace(staged, unit_s={unit_key("ag"): 61.0})
    with pytest.raises(PlanError, match="kind is one of"):
        unit_key("all_to_all")


def test_local_shapes_and_missing_calibration():
    lays = [Layout.of({"dp_shard": 4}), Layout.of({"dp_replicate": 2, "dp_shard": 2}),
            Layout.of({"dp_replicate": 2, "dp_shard": 2}, reduce="bf16"),
            Layout.of({"dp_replicate": 2, "dp_shard": 1, "tp": 2}),
            Layout.of({"dp_replicate": 4}), Layout.of({"pp": 2, "dp_shard": 2}),
            Layout.of({"pp": 2, "tp": 2})]
    shapes = local_shapes(lays, Links(2, 2, 100.0))
    assert set(shapes) == {"fsdp/fp32", "fsdp/bf16", "tp2/fp32", "none/fp32", "none/fp32/mb2",
                           "tp2/fp32/mb2", "tp2/fp32/mb2@alone", "pp2/fp32/mb4"}
    assert shapes["tp2/fp32/mb2@alone"] == shapes["tp2/fp32/mb2"]
    assert accumulation("tp2/fp32/mb2@alone") == 2
    assert shapes["none/fp32/mb2"] == Layout.of({"dp_replicate": 4})
    assert shapes["pp2/fp32/mb4"].dims == {"pp": 2, "dp_replicate": 2}
    # a node of one rank cannot hold a 2-stage pipeline: the bubble stays modelled
    assert "pp2/fp32/mb4" not in local_shapes(lays, Links(4, 1, 100.0))
    assert accumulation("tp2/fp32/mb2") == 2 and accumulation("fsdp/bf16") == 1
    assert shapes["tp2/fp32"].dims == {"dp_replicate": 2, "tp": 2}
    assert local_key(lays[4]) is None
    with pytest.raises(PlanError, match="no local step for 'tp2/bf16'"):
        predict_calibrated(Layout.of(lays[3].mesh, reduce="bf16"), STATS, Links(2, 2, 100.0),
                           WORK, CAL)
    with pytest.raises(PlanError, match="gloo_Bps"):
        Calibration(0.001, 0.0, 0.0)
