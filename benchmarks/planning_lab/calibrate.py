"""Step time from a one-node calibration plus modelled cross-node communication.

:func:`ray_mesh.planning.cost.predict` counts bytes well (2-8% off the interface counters)
but prices time as arithmetic plus wire time. On CPU with gloo, and on any small model,
what a step costs beyond its arithmetic is mostly fixed per call or per byte on the CPU:
FSDP2's all-gather copies, casts and per-unit hooks, gloo's reduce-scatter run as an
all-reduce, the pipeline schedule's per-microbatch sends. Those are measured, not modelled:
each node, alone and all nodes at once (so they share cores as in the real run), runs

* the **local shape** of each layout family: the very same step with every cross-node dim
  taken out (``parallelize(..., dp="replica")``: FSDP over the node's ranks, or TP over
  them), the per-rank batch unchanged; for ``fsdp``/``hsdp`` one shape, for ``tp_hsdp`` one
  per tp degree, each in the reduce dtype the layout uses;
* the arithmetic: the same step with no data parallel at all, each rank alone on its share
  of the batch (``Workload.compute_s / world`` when not measured);
* one-element all-reduces inside the node (a collective's fixed cost), an all-reduce of a
  buffer the size of the replicate reduction (gloo's CPU bytes per second), and a
  point-to-point send of one microbatch's activations (the pipeline's per-microbatch cost).

The prediction of a layout is then::

    step_s = local_s + link_s + cross_volume / gloo_Bps + cross_calls * collective_s

``link_s`` is :func:`~ray_mesh.planning.cost.predict`'s wire time for the bytes that cross
nodes (plus link latency per message); ``cross_volume`` is what one rank's cross-node ring
moves beyond what its local shape already moved (gloo spends CPU on every byte it sends and
reduces, whatever the link); ``cross_calls`` the collectives the cross dim adds.

When the link itself was measured with the collective library (``measure_cross`` in
:mod:`benchmarks.planning_lab.measure`: every node's ranks all-reduce with their peers on the
other nodes at once, a small and a large buffer), the last three terms become what that
measurement says a byte and a call across nodes cost, with the wire, the kernel's network
path and gloo's CPU work in it::

    step_s = local_s + node_cross_bytes / cross_Bps + cross_calls * cross_call_s

``cross_Bps`` comes from the replicate groups' pattern (every rank of a node in a group of
its own, all at once: several flows out of each node); DDP's one ring over the whole world
(one flow out of each node, each ring step waiting on the one before) is timed as such at
two sizes (``ring_Bps`` and ``ring_call_s``, what a call costs beyond its bytes: 16 ms at
20 Mbit/s against 0.5-1 ms for a one-element all-reduce). A pipeline's link, where measured,
is one microbatch sent one way across nodes, every pipeline at once (``send_s``: a GPipe
phase sends one way, an all-reduce both ways, the reverse data sharing the shaped queue with
the acknowledgements). Flat FSDP stays priced by the ring: its own calls timed alone
(one unit's all-gather and reduce-scatter over the world) ran at the link's full rate, 18%
under its step at 20 Mbit/s, where the step moved 7% more bytes than its payload (1% at
1 Gbit/s) at ~87% of the rate.

A raw TCP probe prices only the wire; on the virtual cluster at 1 Gbit/s the network path
through veth and tc runs on the same cores as the ranks, which the probe does not see. Overlap
rule: none, except in a pipeline (below). On CPU the cores that compute are the ones that
run gloo's copies and reductions, and a link slower than the CPU keeps the step waiting on
the wire: the terms add.
Pipeline layouts are not runnable inside one node with FSDP beside them; a stage's rank
does its share of the work in microbatches, so their local shapes run with gradient
accumulation over ``microbatches / pp`` chunks (``/mbK`` in the key): per rank that is the
same tokens per call and the same number of calls as one stage's share of the layers over
all microbatches. tp_hsdp = TP's local shape + FSDP's overhead (FSDP's local step less the
arithmetic: the layout wraps its TP blocks in FSDP2, the TP-only local shape does not).
A pipeline is priced as the GPipe schedule it runs (:func:`gpipe_s`): its stages (the
local shape's time over the microbatches, backward twice the forward) and the links between
them (a microbatch's activations at ``cross_Bps``) in one line, so a link faster than a
stage costs its time once per direction and a slower one sets the pace, instead of its
bytes adding to every step; a link carries a microbatch only after the receiving stage is
done with the one before (:mod:`benchmarks.planning_lab.gpipe`: a send waits for its recv), and a
node's pipelines side by side fill each other's gaps. The bubble is measured, not
assumed: where a node holds ``pp`` ranks the pipeline itself runs inside each node
(:func:`pipeline_key`, on ``node_pipeline_mesh``), and its step over the same work's ideal
schedule (:func:`pipeline_efficiency`, its sends included) scales pp's stages; tp_pp's stage
shape is timed with every node busy and with one node at a time (:func:`alone_key`), and
:func:`gpipe_s` runs a stage at the alone speed whenever it computes alone (the fill and
drain, and a slow link's turns, where the other stage waits). On devices of
their own both come out 1; on the 2-core virtual cluster the in-node pipeline read
0.96-1.08 (the bubble costs its share) and TP's stage alone ran in ~0.55 of its busy time
(its per-layer collectives wait on a partner scheduled away while 4 ranks share 2 cores).
pp adds FSDP's overhead (its local step less the arithmetic) for one stage's share of the
parameters (the pipeline keeps them gathered across microbatches).

The calibration never runs a cross-node layout, so it never sees the step times it predicts.
:mod:`benchmarks.planning_lab.measure` runs on a live process group (torch only, no Ray); the local
shapes need the train step, so their runner lives beside it (``benchmarks/slowlinks.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from benchmarks.planning_lab.gpipe import gpipe_s
from ray_mesh.core.layout import Layout
from ray_mesh.planning.cost import (
    BF16,
    FP32,
    Links,
    ModelStats,
    PlanError,
    Prediction,
    Workload,
    predict,
)


@dataclass(frozen=True)
class Calibration:
    """What one node measured; every figure is a median over repeats and ranks."""

    collective_s: float  # one tiny all-reduce inside a node: the fixed cost of a call
    gloo_Bps: float  # ring volume per second of a large all-reduce inside a node
    p2p_s: float  # one microbatch's activations sent to the next rank inside a node
    local_s: dict[str, float] = field(default_factory=dict)  # local shape -> step seconds
    cross_call_s: float = 0.0  # one tiny all-reduce across nodes (0: not measured)
    cross_Bps: float = 0.0  # bytes a node sends across per second in gloo (0: not measured)
    ring_Bps: float = 0.0  # the same for one all-reduce over the whole world (0: not measured)
    ring_call_s: float = 0.0  # that all-reduce's fixed cost per call, fitted from two sizes
    send_s: float = 0.0  # one microbatch across a stage boundary, one way (0: not measured)
    unit_s: dict[str, float] = field(default_factory=dict)  # unit_key -> a unit's call in a node

    def __post_init__(self) -> None:
        for name, v in [("collective_s", self.collective_s), ("p2p_s", self.p2p_s),
                        ("send_s", self.send_s), *self.unit_s.items()]:
            if not 0 <= v < 60:
                raise PlanError(f"calibration {name}={v!r}: give seconds in [0, 60)")
        if not 0 < self.gloo_Bps < math.inf:
            raise PlanError(f"calibration gloo_Bps={self.gloo_Bps!r}: give bytes/s above 0")
        if (not 0 <= self.cross_call_s < 60 or not 0 <= self.ring_call_s < 60
                or not 0 <= self.cross_Bps < math.inf or not 0 <= self.ring_Bps < math.inf):
            raise PlanError(f"calibration cross_call_s={self.cross_call_s!r}, ring_call_s="
                            f"{self.ring_call_s!r}, cross_Bps={self.cross_Bps!r}, ring_Bps="
                            f"{self.ring_Bps!r}: give seconds in [0, 60) and bytes/s >= 0 "
                            "(0: not measured)")

    def local(self, key: str) -> float:
        if key not in self.local_s:
            raise PlanError(f"the calibration has no local step for {key!r} (it has "
                            f"{sorted(self.local_s)}); calibrate the layouts you predict "
                            "(local_shapes() lists the ones they need)")
        return self.local_s[key]

    def to_json(self) -> dict[str, object]:
        return {"collective_s": self.collective_s, "gloo_Bps": self.gloo_Bps,
                "p2p_s": self.p2p_s, "local_s": dict(self.local_s),
                "cross_call_s": self.cross_call_s, "cross_Bps": self.cross_Bps,
                "ring_Bps": self.ring_Bps, "ring_call_s": self.ring_call_s,
                "send_s": self.send_s, "unit_s": dict(self.unit_s)}

    def node_unit_s(self, reduce: str) -> float | None:
        """One FSDP unit's collectives over a node's ranks: two all-gathers (forward, and
        again in backward: FSDP2 reshards after forward) and a reduce-scatter in
        ``reduce``; None where not measured."""
        keys = [unit_key("ag", "fp32"), unit_key("rs", reduce)]
        if not all(k in self.unit_s for k in keys):
            return None
        return 2 * self.unit_s[keys[0]] + self.unit_s[keys[1]]


ARITHMETIC = "none/fp32"  # the local shape without any data parallel: the arithmetic


def local_key(layout: Layout, microbatches: int = 4) -> str | None:
    """The one-node shape whose step a layout's prediction starts from; None: ddp (the
    arithmetic, :data:`ARITHMETIC`)."""
    fam, tp, pp = layout.family, layout.mesh.tp, layout.mesh.pp
    chunks = f"/mb{max(1, microbatches // pp)}"
    if fam in ("fsdp", "hsdp"):
        return f"fsdp/{layout.reduce}"
    if fam == "tp_hsdp":
        return f"tp{tp}/{layout.reduce}"
    if fam == "tp_pp":
        return f"tp{tp}/{layout.reduce}{chunks}"
    if fam == "pp":
        return ARITHMETIC + chunks
    return None


def pipeline_key(pp: int, microbatches: int = 4) -> str:
    """The one-node shape that runs the pipeline itself: ``pp`` consecutive ranks of a node
    as the stages (no data parallel among them, the nodes' pipelines side by side), its
    batch in ``microbatches`` microbatches. Measured where a node holds ``pp`` ranks."""
    return f"pp{pp}/fp32/mb{microbatches}"


def accumulation(key: str) -> int:
    """How many chunks a local shape's step splits its batch into (``/mbK``; else 1)."""
    tail = key.removesuffix("@alone").rsplit("/", 1)[-1]
    return int(tail[2:]) if tail.startswith("mb") else 1


def local_shapes(layouts: list[Layout], links: Links, microbatches: int = 4
                 ) -> dict[str, Layout]:
    """``{key: layout to run with dp="replica"}``: one node-local shape per key.

    fsdp and hsdp (and pp's in-stage FSDP) share FSDP over a node's ranks, run as the HSDP
    mesh in replica mode; tp layouts run their tp_hsdp mesh in replica mode (TP only); the
    arithmetic is the DDP mesh in replica mode (each rank alone on its share of the batch).
    """
    out: dict[str, Layout] = {}
    keys = [ARITHMETIC] if any(x.family == "ddp" for x in layouts) else []
    for lay in layouts:
        key = local_key(lay, microbatches)
        keys += [key] if key else []
        if lay.family == "pp" and lay.mesh.dp_shard > 1:
            keys += [ARITHMETIC, "fsdp/fp32"]  # FSDP's overhead: the two of them
        if lay.family == "tp_pp" and links.nodes > 1:  # its stage shape, one node at a time
            keys += [alone_key(key or "")]
        pp = lay.mesh.pp
        if pp > 1 and links.per_node % pp == 0:  # the schedule's own cost, run in a node,
            # against the same work without a pipeline (the arithmetic in chunks)
            keys += [pipeline_key(pp, microbatches),
                     ARITHMETIC + f"/mb{max(1, microbatches // pp)}"]
        if lay.family == "tp_hsdp":  # TP's local shape has no FSDP2 wrapper; the layout has
            keys += [ARITHMETIC, f"fsdp/{lay.reduce}"]
    world = links.nodes * links.per_node
    for key in dict.fromkeys(keys):
        kind, reduce = key.removesuffix("@alone").split("/")[:2]
        tp = int(kind[2:]) if kind.startswith("tp") else 1
        if kind.startswith("pp"):  # run with the pp dim inside the node (node_pipeline_mesh)
            pp = int(kind[2:])
            out[key] = Layout.of({"pp": pp, "dp_replicate": world // pp}, reduce=reduce)
            continue
        if links.per_node % tp:  # a node's ranks cannot hold this tp degree: not a shape
            continue
        mesh = ({"dp_replicate": world} if kind == "none" else
                {"dp_replicate": links.nodes, "dp_shard": links.per_node // tp,
                 **({"tp": tp} if tp > 1 else {})})
        out[key] = Layout.of(mesh, reduce=reduce)
    return out


def alone_key(key: str) -> str:
    """A local shape stepped by one node at a time while the others wait: a stage's speed
    when the other stages idle (a pipeline's fill and drain)."""
    return key + "@alone"


def pipeline_efficiency(cal: Calibration, pp: int, microbatches: int) -> float:
    """Measured pipeline step inside a node / the same work's ideal GPipe time.

    1 on devices of their own; below 1 where the stages share cores (an idle stage's
    core runs the busy one) and above it where sends cost; 1 when not measured (a node
    holds fewer than ``pp`` ranks)."""
    pipe = cal.local_s.get(pipeline_key(pp, microbatches))
    plain = cal.local_s.get(ARITHMETIC + f"/mb{max(1, microbatches // pp)}")
    if not pipe or not plain:
        return 1.0
    return pipe / (plain * (microbatches + pp - 1) / microbatches)


def predict_calibrated(layout: Layout, stats: ModelStats, links: Links, work: Workload,
                       cal: Calibration) -> Prediction:
    """:func:`predict`'s bytes and memory with the step time of the module docstring."""
    base = predict(layout, stats, links, work)
    m = layout.mesh
    pp, rep, shard, tp = m.pp, m.dp_replicate, m.dp_shard, m.tp
    n, g = links.nodes, links.per_node
    world = n * g
    p_b = stats.params * FP32 / pp
    g_b = stats.params * (BF16 if layout.reduce == "bf16" else FP32) / pp
    blocks = stats.layers / pp + 1
    arithmetic = cal.local_s.get(ARITHMETIC, work.compute_s / world)  # one rank, its share
    fam = layout.family
    calls = 1.0  # the step's loss mean over dp
    exposed = 0.0  # a pipeline's link time not hidden behind its stages
    if fam == "ddp":
        local = arithmetic
        volume = 2 * (rep - 1) / rep * g_b
        calls += max(1, math.ceil(g_b / 25e6))  # DDP's 25 MB buckets
    elif fam in ("fsdp", "hsdp", "tp_hsdp"):
        local = cal.local(local_key(layout) or "")
        if fam == "tp_hsdp":  # FSDP2 wraps the TP blocks over replicate x shard: its hooks,
            # copies and casts, which TP's local shape (no FSDP) does not run, as FSDP's
            # local shape measured them beyond the arithmetic
            # less the in-node all-gathers and reduce-scatters FSDP's local shape ran and
            # tp_hsdp's (dp_shard 1) does not, where measured
            units = blocks * (cal.node_unit_s(layout.reduce) or 0.0) if shard == 1 else 0.0
            local += max(0.0, cal.local(f"fsdp/{layout.reduce}") - arithmetic - units)
        if fam == "fsdp":  # gloo: all-gather twice + reduce-scatter as an all-reduce
            def ring(k: int) -> float:
                return (k - 1) / k * (2 * p_b + 2 * g_b)
            volume = ring(world) - ring(g)
        else:  # each rank all-reduces its shard over the replicas
            volume = 2 * (rep - 1) / rep * g_b / (shard * tp)
            calls += blocks
    else:  # pp, tp_pp: stages across nodes, a GPipe schedule with the links in the line
        mbs = work.microbatches
        key = local_key(layout, mbs) or ""
        stage = cal.local(key) / mbs  # one microbatch, one stage
        if fam == "tp_pp" and alone_key(key) in cal.local_s:  # TP's stages: its own speeds,
            # busy and alone, in the schedule as it runs (gpipe_s)
            eff, alone = 1.0, min(1.0, cal.local(alone_key(key)) / cal.local(key))
        else:
            eff, alone = pipeline_efficiency(cal, pp, mbs), 1.0
        boundary = work.tokens * stats.hidden * FP32 / mbs  # a node's send per microbatch
        if cal.send_s and n > 1:  # measured as the schedule sends: one way, side by side
            link = cal.send_s
        elif cal.cross_Bps and n > 1:
            link = boundary / cal.cross_Bps + cal.cross_call_s / 2
        else:
            link = (boundary * 8 / (links.cross_mbit * 1e6) + boundary / cal.gloo_Bps
                    + links.latency_s)
        fwd, bwd = stage / 3 * eff, 2 * stage / 3 * eff  # backward: twice the forward
        local = gpipe_s(fwd, bwd, 0.0, mbs, pp, alone=alone)
        # a link waits for its receiver's recv (gpipe.py); a node's k pipelines side by
        # side (pp with dp in the node) each carry a microbatch alone while the others
        # compute, at k times the shared rate, and together no faster than the link
        k = max(1, g // (tp * m.cp))
        exposed = max(gpipe_s(fwd, bwd, link / k, mbs, pp, rendezvous=True, alone=alone),
                      gpipe_s(fwd, bwd, link, mbs, pp, alone=alone)) - local
        if fam == "pp" and shard > 1:
            local += max(0.0, cal.local("fsdp/fp32") - arithmetic) / pp
        if pipeline_key(pp, mbs) not in cal.local_s:  # else the sends are in eff
            local += 2 * mbs * (2 if pp > 2 else 1) * cal.p2p_s
        volume = 0.0  # the sends are in the schedule above; calls: the loss mean
    if layout.diloco:  # the replicate dim syncs once every H steps (the local shape is
        every = layout.diloco.every  # DiLoCo's inner step itself)
        volume, calls = volume / every, 1 + (calls - 1) / every
    pipeline = fam in ("pp", "tp_pp")
    if cal.cross_Bps and n > 1:  # the link as gloo sees it, measured
        # a collective over the whole world runs one ring through every node (one flow
        # out of each), measured as such where it was; the replicate groups run several
        world_ring = fam in ("ddp", "fsdp") and cal.ring_Bps > 0
        rate = cal.ring_Bps if world_ring else cal.cross_Bps
        call_s = max(cal.ring_call_s, cal.cross_call_s) if world_ring else cal.cross_call_s
        if fam == "fsdp":  # every all-gather and reduce-scatter now spans the nodes (the
            # local shape paid their in-node fixed cost)
            calls += 3 * blocks * max(0.0, 1 - cal.collective_s / max(call_s, 1e-12))
        volume_s = exposed if pipeline else base.cross_node_bytes_per_step / n / rate
        comm = volume_s + calls * call_s
    else:
        comm = (exposed if pipeline else base.cross_s) + volume / cal.gloo_Bps \
            + calls * cal.collective_s
    return Prediction(layout, local + comm, local, base.cross_s, comm - base.cross_s,
                      base.cross_node_bytes_per_step, base.memory_bytes_per_rank,
                      base.notes + ["calibrated on one node"])


UNIT_KINDS = ("ag", "rs")  # FSDP2's all_gather_single and reduce_scatter_single


def unit_key(kind: str, dtype: str = "fp32") -> str:
    """Name of one FSDP unit's collective over a node's ranks in ``Calibration.unit_s``:
    all-gather ("ag", the fp32 parameters) or reduce-scatter ("rs", gradients in
    ``dtype``)."""
    if kind not in UNIT_KINDS:
        raise PlanError(f"unit_key({kind!r}): kind is one of {UNIT_KINDS}")
    return f"{kind}/{dtype}"


__all__ = ["ARITHMETIC", "UNIT_KINDS", "Calibration", "accumulation", "alone_key", "gpipe_s",
           "local_key", "local_shapes", "pipeline_efficiency", "pipeline_key",
           "predict_calibrated", "unit_key"]
