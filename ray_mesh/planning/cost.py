"""A cost model for mesh layouts on a cluster whose nodes are joined by a slow link.

What decides the step time of a small cluster over a VPN is the traffic that crosses
nodes. For every layout this module counts the bytes each node sends over its link per
step (collectives as rings over node-aligned ranks), adds the within-node traffic, and puts
them beside the compute time of one step:

``step_s = compute_s * bubble + cross_bytes_per_node / cross_Bps + intra_bytes / intra_Bps
+ latency_s * cross_messages + collective_s * collective_calls``

``collective_s`` is the fixed cost of one collective call whatever its size: tens of µs
with NCCL, milliseconds with gloo on a busy CPU (tensor parallelism makes ~8 calls per layer
per step, so it decides TP on CPU). The benchmark calibrates it with a one-element
all-reduce inside a node.

DiLoCo layouts (``replicate`` mode diloco, every H steps, pseudo-gradients compressed as
none/bf16/int8): the replicate dim carries no gradients; every H steps it averages one
parameter-sized pseudo-gradient (fp32, bf16: half, int8: a quarter plus per-chunk scales,
all-gathered), so per inner step the cross-node bytes are sync HSDP's / H x the ratio, and
the sync's collective calls and latency are amortised over H. The outer state (global
params, momentum, int8 error feedback) adds 2-3 fp32 copies of a rank's shard to memory.
What the model cannot say: the loss reached per token, usually somewhat worse than sync's
(``benchmarks/diloco.py`` measures both).

No overlap of communication with compute is assumed (an upper bound for FSDP's prefetch).
Ring volumes, per rank, for a collective over k ranks of a buffer of B bytes:

* all-reduce ``2 (k-1)/k B``; all-gather ``(k-1)/k B``;
* reduce-scatter ``(k-1)/k B`` on NCCL, but ``2 (k-1)/k B`` on gloo, whose reduce-scatter
  is an all-reduce followed by a slice (measured: flat FSDP moved 3.0x HSDP's bytes across
  nodes on gloo, which is what these two rules give for 2 nodes x 2 ranks).

A node hosts consecutive ranks (``tp``, ``cp``, ``dp_shard`` inside a node), so a ring over
ranks of several nodes leaves each node once per step of the ring: the bytes a node sends
over its link equal one rank's ring volume. The busiest node link sets the time.

Ray-free and torch-free: the inputs are plain numbers (:class:`ModelStats` can read them
off a module built on the meta device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ray_mesh.core.layout import DiLoCoConfig, Layout, check_family, family_mesh
from ray_mesh.core.values import read_int
from ray_mesh.errors import PlanError

FP32 = 4
BF16 = 2
# Params + grads + AdamW's two moments, fp32: what FSDP shards.
STATE_BYTES_PER_PARAM = 4 * FP32
# Activation memory per token per layer kept for backward, in units of hidden * 4 bytes
# (attention and MLP inputs, norms, the MLP's wide hidden): a rough planning figure.
ACT_FACTOR = 12


@dataclass(frozen=True)
class ModelStats:
    """What the cost model needs of a model: sizes, not weights."""

    params: int
    layers: int
    hidden: int
    heads: int = 1

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "heads"):
            read_int(f"model {name}", getattr(self, name), 1, error=PlanError)

    @classmethod
    def from_module(cls, module: object, heads: int | None = None) -> ModelStats:
        """Count parameters, blocks and hidden size of a module (meta device is fine)."""
        import torch.nn as nn

        if not isinstance(module, nn.Module):
            raise PlanError(f"ModelStats.from_module needs a torch nn.Module, got "
                            f"{type(module).__name__}")
        params = sum(p.numel() for p in module.parameters())
        blocks = [m for m in module.modules() if isinstance(m, nn.ModuleList | nn.Sequential)]
        layers = max((len(b) for b in blocks), default=1)
        emb = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        lin = [m for m in module.modules() if isinstance(m, nn.Linear)]
        hidden = emb[0].embedding_dim if emb else (lin[0].in_features if lin else 1)
        found = heads or getattr(module, "n_heads", None) or getattr(
            getattr(module, "config", None), "n_heads", None) or 1
        return cls(int(params), int(max(layers, 1)), int(hidden), int(found))


@dataclass(frozen=True)
class Links:
    """The cluster as the cost model sees it: node count, ranks per node and link rates."""

    nodes: int
    per_node: int
    cross_mbit: float
    intra_mbit: float = 50_000.0
    latency_s: float = 0.0
    backend: str = "gloo"
    collective_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            read_int(name, getattr(self, name), 1, error=PlanError)
        for name in ("cross_mbit", "intra_mbit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < math.inf:
                raise PlanError(f"{name}={v!r}: give a link rate in Mbit/s above 0 "
                                "(measure it with `ray-mesh doctor`)")
        for name in ("latency_s", "collective_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 10:
                raise PlanError(f"{name}={v!r}: give seconds in [0, 10)")
        if self.backend not in ("gloo", "nccl"):
            raise PlanError(f"backend={self.backend!r}: use 'gloo' or 'nccl'")


@dataclass(frozen=True)
class Workload:
    """One training step: global tokens, one rank's compute time for ALL of them, microbatches.

    ``compute_s`` is what one rank would take for the whole global batch (calibrate by
    timing a few steps of a smaller batch on one node and scaling by tokens); a layout with
    N ranks divides it by N.

    ``tp_compute_s`` optionally maps a tensor-parallel degree t to the time one tp group of
    t ranks takes for the whole global batch, measured on one node (TP's own collectives and
    per-op overhead included, which on CPU outweigh its arithmetic); a layout with that t
    uses it instead of modelling TP's traffic.
    """

    tokens: int
    compute_s: float
    microbatches: int = 4
    tp_compute_s: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise PlanError(f"tokens per step={self.tokens!r}: give a positive integer")
        if not 0 <= self.compute_s < math.inf:
            raise PlanError(f"compute_s={self.compute_s!r}: give seconds >= 0")
        if self.microbatches < 1:
            raise PlanError(f"microbatches={self.microbatches!r}: give an integer >= 1")


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    compute_s: float
    cross_s: float
    intra_s: float
    cross_node_bytes_per_step: float  # summed over nodes (what all node links carry)
    memory_bytes_per_rank: float
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"layout": str(self.layout), "family": self.layout.family,
                **self.layout.to_dict(), "predicted_step_s": self.step_s,
                "compute_s": self.compute_s, "cross_s": self.cross_s, "intra_s": self.intra_s,
                "cross_node_bytes_per_step": self.cross_node_bytes_per_step,
                "memory_bytes_per_rank": self.memory_bytes_per_rank}


def _ar(k: int) -> float:
    return 2 * (k - 1) / k


def _ag(k: int) -> float:
    return (k - 1) / k


def _rs(k: int, backend: str) -> float:
    return _ar(k) if backend == "gloo" else _ag(k)


def diloco_sync_bytes(rep: int, param_bytes: float, compress: str) -> float:
    """Bytes one rank (one node) sends in a DiLoCo sync of ``param_bytes`` fp32 over ``rep``
    replicas: a ring all-reduce (fp32, bf16), or int8 codes + scales all-gathered."""
    if compress == "int8":
        return (rep - 1) * param_bytes / FP32 * (1 + FP32 / 1024)
    return _ar(rep) * param_bytes * (0.5 if compress == "bf16" else 1.0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


DATA_PARALLEL = ("ddp", "fsdp", "hsdp")
PLANNED_FAMILIES = ("ddp", "fsdp", "hsdp", "tp_hsdp", "pp", "tp_pp")
"""The families the cost model ranks (:data:`ray_mesh.core.layout.FAMILIES` less pp_tp_hsdp)."""


def candidates(stats: ModelStats, links: Links, families: tuple[str, ...] = PLANNED_FAMILIES,
               bf16: bool = True, diloco: DiLoCoConfig | None = None) -> list[Layout]:
    """Every layout of the families below that fits the cluster and the model.

    ddp, fsdp (flat), hsdp, tp_hsdp (tp inside a node), pp (stages across nodes, FSDP
    inside), tp_pp (stages across nodes, TP inside: the seed blog's layout); fsdp and the
    hsdp family also with gradients reduced in bf16 (their reduction is what crosses);
    with ``diloco`` the hsdp and tp_hsdp layouts also in replicate mode diloco.
    """
    unknown = sorted(set(families) - set(PLANNED_FAMILIES))
    if unknown:
        for name in unknown:
            check_family(name)  # an old spelling is named as such
        raise PlanError(f"the planner does not rank the families {unknown}; choose from "
                        f"{', '.join(PLANNED_FAMILIES)}")
    n, g = links.nodes, links.per_node
    out: list[tuple[str, Layout]] = [("ddp", Layout.of(family_mesh("ddp", n, g))),
                                     ("fsdp", Layout.of(family_mesh("fsdp", n, g)))]
    if n > 1:
        out.append(("hsdp", Layout.of(family_mesh("hsdp", n, g))))
    for t in _divisors(g):
        if t > 1 and stats.heads % t == 0 and stats.hidden % t == 0:
            out.append(("tp_hsdp", Layout.of(family_mesh("tp_hsdp", n, g, tp=t))))
    if n > 1 and stats.layers >= n:
        out.append(("pp", Layout.of(family_mesh("pp", n, g))))
        if g > 1 and stats.heads % g == 0 and stats.hidden % g == 0:
            out.append(("tp_pp", Layout.of(family_mesh("tp_pp", n, g))))
    # The family that proposed a layout decides what is kept and varied (hsdp on one worker
    # per node has ddp's dims; it is still what plan.layouts: [hsdp] asked for).
    kept: list[tuple[str, Layout]] = []
    for fam, lay in out:
        if fam in families and all(lay != other for _, other in kept):
            kept.append((fam, lay))
    if bf16:  # bf16 gradient reduction where the reduction is what crosses nodes
        kept += [(fam, replace(lay, reduce="bf16")) for fam, lay in kept
                 if fam in ("fsdp", "hsdp", "tp_hsdp")]
    if diloco:
        kept += [(fam, replace(lay, diloco=diloco)) for fam, lay in kept
                 if fam in ("hsdp", "tp_hsdp") and lay.reduce == "fp32"
                 and lay.mesh.dp_replicate > 1]
    return [lay for _, lay in kept]


def predict(layout: Layout, stats: ModelStats, links: Links, work: Workload) -> Prediction:
    """Step time, cross-node bytes and memory of one layout (see the module docstring)."""
    m = layout.mesh
    if not m.is_resolved:
        raise PlanError(f"layout {layout}: give every dim a size to predict it (resolve "
                        "-1 and nodes against the cluster first)")
    pp, rep, shard, tp = m.pp, m.dp_replicate, m.dp_shard * m.cp, m.tp
    n, g = links.nodes, links.per_node
    world = pp * rep * shard * tp
    if world != n * g:
        raise PlanError(f"layout {layout} has {world} ranks, the cluster {n * g}")
    p_b = stats.params * FP32
    g_b = stats.params * (BF16 if layout.reduce == "bf16" else FP32)
    stage_p, stage_g = p_b / pp, g_b / pp
    dp = rep * shard
    tokens_dp = work.tokens / dp  # tokens one dp group (all its tp ranks) handles
    act_b = tokens_dp * stats.hidden * FP32  # one stage boundary's activations, one dp group
    # Bytes one node sends per step: over its link (cross) and inside it (intra). For a
    # collective whose groups span nodes, each group's ring leaves a node once per ring
    # step, and the node's groups together hold the whole (stage) buffer.
    cross = intra = 0.0
    msgs = 0
    blocks = stats.layers / pp + 1  # FSDP units of a stage: its blocks and the root
    calls = 0.0  # collective calls per step, any group
    notes: list[str] = []
    shard_vol = 2 * _ag(shard) * stage_p + _rs(shard, links.backend) * stage_g
    if shard > 1:
        calls += 3 * blocks  # all-gather forward and backward, reduce-scatter
        if tp * shard > g:  # flat FSDP over several nodes: everything crosses
            cross += shard_vol
            msgs += stats.layers * 3 * (shard - 1)
        else:
            intra += shard_vol * g / shard
    if rep > 1 and layout.diloco:  # one sync every H inner steps, amortised per step
        every, compress = layout.diloco.every, layout.diloco.compress
        calls += (2 if compress == "int8" else 1) * blocks / every
        volume = diloco_sync_bytes(rep, stage_p, compress) / every  # the node's shards
        if tp * shard * rep > g:
            cross += volume
            msgs += stats.layers * 2 * (rep - 1) / every
        else:
            intra += volume * g / (rep * shard)
        notes.append(f"DiLoCo every {every} ({compress}): fewer bytes, loss per token may "
                     "be worse than sync")
    elif rep > 1:  # DDP, or HSDP's all-reduce of each node's shard
        calls += blocks if shard > 1 else 2  # per FSDP unit; DDP: a couple of buckets
        if tp * shard * rep > g:
            cross += _ar(rep) * stage_g
            msgs += stats.layers * 2 * (rep - 1)
        else:
            intra += _ar(rep) * stage_g * g / (rep * shard)
    tp_measured = dict(work.tp_compute_s).get(tp) if tp > 1 else None
    if tp > 1 and tp_measured is None:  # sequence-parallel TP: per layer 2 all-gathers +
        calls += 8 * stats.layers / pp + 4  # 2 reduce-scatters, forward and backward
        intra += stats.layers / pp * 2 * (_ag(tp) + _rs(tp, links.backend)) * act_b * (g / tp)
    if pp > 1:
        # A stage boundary carries every dp group's activations forward and their gradients
        # back (one copy per dp group: with TP the stage output is taken as replicated and
        # sent once); an end node sends one direction's worth, a middle node two.
        cross += act_b * dp * (2 if pp > 2 else 1)
        msgs += 2 * work.microbatches
        calls += 2 * work.microbatches * (2 if pp > 2 else 1)
        notes.append(f"pipeline bubble {(pp - 1) / (work.microbatches + pp - 1):.0%}")
    bubble = (work.microbatches + pp - 1) / work.microbatches if pp > 1 else 1.0
    compute = (tp_measured / (world / tp) if tp_measured is not None
               else work.compute_s / world) * bubble
    cross_Bps = links.cross_mbit * 1e6 / 8
    intra_Bps = links.intra_mbit * 1e6 / 8
    cross_s = (cross / cross_Bps if n > 1 else 0.0) + links.latency_s * msgs
    intra_s = intra / intra_Bps + links.collective_s * calls
    if n == 1:
        intra_s += cross / intra_Bps
        cross = 0.0
    state = STATE_BYTES_PER_PARAM * stats.params / (pp * shard * tp)
    if layout.diloco:  # global params, outer momentum, int8 error feedback
        state *= 1 + (3 if layout.diloco.compress == "int8" else 2) * FP32 / STATE_BYTES_PER_PARAM
    act_mem = tokens_dp / tp * stats.hidden * FP32 * ACT_FACTOR * stats.layers / pp
    return Prediction(layout, compute + cross_s + intra_s, compute, cross_s, intra_s,
                      cross * n, state + act_mem, notes)


def rank_layouts(stats: ModelStats, links: Links, work: Workload,
                 memory_limit_bytes: float | None = None,
                 families: tuple[str, ...] = PLANNED_FAMILIES, bf16: bool = True,
                 diloco: DiLoCoConfig | None = None) -> list[Prediction]:
    """Every candidate's prediction, fastest first; those over the memory limit left out.

    Raises :class:`PlanError` when no layout fits the memory limit.
    """
    preds = [predict(lay, stats, links, work)
             for lay in candidates(stats, links, families, bf16, diloco)]
    if not preds:
        raise PlanError(f"no layout of the families {list(families)} fits {links.nodes} "
                        f"node(s) x {links.per_node} worker(s) and this model; allow more "
                        f"families (plan.layouts) from {', '.join(PLANNED_FAMILIES)}")
    fits = [p for p in preds
            if memory_limit_bytes is None or p.memory_bytes_per_rank <= memory_limit_bytes]
    if not fits:
        least = min(preds, key=lambda p: p.memory_bytes_per_rank)
        raise PlanError(
            f"the model ({stats.params:,} parameters) fits no layout on {links.nodes} node(s) x "
            f"{links.per_node} rank(s): the leanest, {least.layout}, needs "
            f"{least.memory_bytes_per_rank / 2**30:.1f} GiB per rank, the limit is "
            f"{memory_limit_bytes / 2**30:.1f} GiB. Use more ranks, a smaller model or "
            "a smaller batch (activations), or raise the limit")
    return sorted(fits, key=lambda p: (p.step_s, p.cross_node_bytes_per_step))


def explain_pick(ranked: list[Prediction]) -> str:
    """One line on why the first layout won (for logs and ``ray-mesh plan``)."""
    best = ranked[0]
    line = (f"picked {best.layout}: predicted {best.step_s:.3g} s/step "
            f"({best.compute_s:.3g} compute, {best.cross_s:.3g} across nodes, "
            f"{best.cross_node_bytes_per_step / 1e6:.3g} MB over node links)")
    if len(ranked) > 1:
        nxt = ranked[1]
        line += f"; next {nxt.layout} at {nxt.step_s:.3g} s"
    return line


def format_ranked(ranked: list[Prediction]) -> str:
    rows = [(str(p.layout), p.layout.family, f"{p.step_s:.3g}",
             f"{p.cross_node_bytes_per_step / 1e6:.3g}",
             f"{p.memory_bytes_per_rank / 2**20:.0f}") for p in ranked]
    header = ("layout", "family", "step s", "cross-node MB/step", "MiB/rank")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                     for r in [header, *rows])
