"""Every candidate layout on shaped links: measured step time and bytes beside the prediction.

The host starts the virtual Tailscale cluster (``harness/netns/``, 2 nodes x
2 workers), and for each link rate shapes both nodes' links (``tc ... tbf``) and runs this
module as a driver inside the head namespace. One ``fit`` per rate; its train function:

1. calibrates on one node, all nodes at once (so they share cores as in the real runs),
   nothing crossing nodes (:mod:`benchmarks.planning_lab.calibrate`): the arithmetic (an
   unsharded copy per rank), the local shape of each layout family (its step with
   ``dp="replica"``), the pipeline itself inside each node (its schedule's cost on this
   machine), gloo's fixed cost per call and bytes per second, one microbatch's send; then
   measures the link as gloo sees it, no model: ``measure_cross`` (a tiny and a large
   all-reduce across nodes in the replicate groups, and one over the whole world),
   ``measure_pipeline_send`` (one microbatch sent one way across, every pipeline at once)
   and ``measure_unit_collectives`` (one FSDP unit's all-gather and reduce-scatter inside a
   node). Every rate's fit calibrates afresh, and the local shapes a layout's prediction
   reads are timed again between its blocks of steps (``local_s_beside``; 3 steps before
   each of 4 blocks and after the last): on a shared 2-core machine the load drifts within
   minutes, and a prediction is only as good as the calibration's match to the conditions
   it predicts;
2. for each layout of the planner's candidates (``ray_mesh.planning.cost.candidates``)
   builds that mesh on the same process group, trains ``steps`` steps after a warm-up, and
   reads each node's ``tailscale0`` counters around them (every byte that crosses nodes
   leaves exactly one node's interface, so the sum of tx deltas is the cross-node traffic);
3. predicts each layout from the calibration and the link rate the backend measured at
   bring-up (``predict_calibrated``; the analytic ``predict`` is kept beside it).

The model is ``examples/fsdp_tp_transformer.py`` (flat ``nn.Sequential``: its pipeline
stages cut it). Statistic: median of the timed steps per layout.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace

from benchmarks.common import (
    REPO,
    fit_netns_workers,
    read_result,
    run_head_driver,
    write_result,
)

MODEL = {"vocab": 256, "dim": 128, "heads": 4, "layers": 4, "ffn": 512, "seq": 64,
         "batch_size": 16, "lr": 0.01, "seed": 0, "mixed_precision": None}
RATES = (1000, 100, 20)


def _rate_key(mbit: float | None) -> str:
    if not mbit:
        return "unshaped"
    return f"{mbit / 1000:g}gbit" if mbit >= 1000 else f"{mbit:g}mbit"


def _step_fn(layout, mesh, cfg, dp: str = "auto", chunks: int = 1):
    """step() for one layout on ``mesh``; ``dp="replica"``: its one-node local shape (no
    data parallel across replicas, no loss mean over them), its batch in ``chunks``
    accumulated microbatches."""
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    import fsdp_tp_transformer as ex

    from ray_mesh.parallel import parallelize, shard_batch

    tp = layout.mesh.tp
    precision = layout.precision
    x, y = ex.batch(0, cfg)
    if dp != "replica":  # the layout as mesh: auto's trials run it (the example's make_step,
        return ex.make_step(mesh, cfg)  # on a mesh built for the layout: its reduce dtype)
    model = parallelize(ex.make_model(cfg), mesh, tp_plan=ex.tp_plan() if tp > 1 else None,
                        mixed_precision=precision, dp=dp)
    optim = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    xs, ys = shard_batch((x, y), mesh)

    def local_step() -> None:
        for xc, yc in zip(xs.chunk(chunks), ys.chunk(chunks), strict=True):
            (ex.loss_fn(model(xc), yc) / chunks).backward()
        optim.step()
        optim.zero_grad()
    return local_step


def _node_pipeline_fn(pp: int, cfg: dict, microbatches: int):
    """step() of the pipeline run inside each node (``pipeline_key``): ``pp`` consecutive
    ranks as the stages, each node's pipeline on its share of the batch, nothing crossing
    nodes: the schedule's cost on this machine, against the same work without it."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    import fsdp_tp_transformer as ex

    from benchmarks.planning_lab.measure import node_pipeline_mesh
    from ray_mesh.parallel import Pipeline

    mesh = node_pipeline_mesh(pp)
    pipe = Pipeline(ex.make_model(cfg), mesh, loss_fn=ex.loss_fn, n_microbatches=microbatches,
                    schedule="gpipe", dp="none")
    optim = torch.optim.SGD(list(pipe.parameters()), lr=cfg["lr"])
    x, y = ex.batch(0, cfg)
    replicas = dist.get_world_size() // pp
    per = x.shape[0] // replicas
    r = dist.get_rank() // pp
    xs, ys = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]

    def step() -> None:
        pipe.step(xs, target=ys)
        optim.step()
        optim.zero_grad()
    return step


def _calibrate(cfg: dict, world: int, steps: int, per_node: int, tp: int = 1) -> float:
    """One tp group's compute time for the whole global batch, measured inside the nodes.

    Every node runs the model on its own ranks at once: tp=1 an unsharded copy per rank,
    tp>1 a TP-only model per tp group inside the node; nothing crosses nodes.
    """
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    import fsdp_tp_transformer as ex

    from ray_mesh.core.bootstrap import build_device_mesh
    from ray_mesh.core.spec import MeshSpec
    from ray_mesh.parallel import apply_tp

    model = ex.make_model(cfg)
    if tp > 1:  # dp_replicate x tp mesh, only its tp dim used: tp groups stay inside nodes
        mesh = build_device_mesh(MeshSpec(dp_replicate=world // tp, dp_shard=1, tp=tp), "cpu")
        model = apply_tp(model, mesh, ex.tp_plan())
    optim = torch.optim.SGD(model.parameters(), lr=cfg["lr"])
    x, y = ex.batch(0, cfg)
    groups = world // tp
    share = max(1, cfg["batch_size"] // groups)
    x, y = x[:share], y[:share]
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        ex.loss_fn(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    mine = statistics.median(times) * cfg["batch_size"] / share
    everyone = [0.0] * world
    dist.all_gather_object(everyone, mine)
    return statistics.median(everyone)


def _timed(step, steps: int, warmup: bool = True, group=None) -> list[float]:
    """Seconds of ``steps`` calls of ``step`` (after a warm-up), each between barriers of
    ``group`` (default: the world)."""
    import torch.distributed as dist

    if warmup:
        step()  # lazy init, first all-gathers
    times = []
    for _ in range(steps):
        dist.barrier(group=group)
        t = time.perf_counter()
        step()
        dist.barrier(group=group)
        times.append(time.perf_counter() - t)
    return times


def _timed_alone(step, reps: int, nodes: list, per_node: int) -> list[float]:
    """``reps`` steps of a node-local ``step`` on one node at a time, the others waiting
    (between node barriers): a stage's speed when the other stages idle."""
    import torch.distributed as dist

    mine = dist.get_rank() // per_node
    times: list[float] = []
    for node, group in enumerate(nodes):
        if node == mine:
            times = _timed(step, reps, warmup=False, group=group)
        dist.barrier()
    return times


def _calibration(config: dict, world: int) -> tuple[dict, dict]:
    """Everything the calibrated prediction needs, measured with nothing crossing nodes;
    and a timer per local shape (reps -> seconds of that many steps), kept to time them
    again between each layout's blocks of steps."""
    import torch.distributed as dist

    from benchmarks.planning_lab.calibrate import accumulation
    from benchmarks.planning_lab.measure import measure_collectives, median_everywhere, node_groups
    from ray_mesh.core.bootstrap import build_device_mesh
    from ray_mesh.core.layout import parse_layout

    cfg, per_node = config["model"], config["per_node"]
    steps = max(config["steps"], 12)  # local shapes are cheap: medians of at least 12
    out = {"compute_s": _calibrate(cfg, world, steps, per_node),
           "tp_compute_s": [[t, _calibrate(cfg, world, steps, per_node, t)]
                            for t in config["tp_degrees"]],
           **measure_collectives(per_node, config["reduce_bytes"], config["p2p_bytes"]),
           "local_s": {}, "local_min_s": {}}
    step_fns: dict = {}  # local shape -> its step
    timers: dict = {}  # local shape -> reps -> seconds of that many steps, timed as it is
    nodes = node_groups(per_node)
    for key, raw in config["local_shapes"].items():
        layout = parse_layout(raw)
        base = key.removesuffix("@alone")
        if base != key:  # the same shape (already warm), one node at a time
            timers[key] = (lambda reps, fn=step_fns[base]:
                           _timed_alone(fn, reps, nodes, per_node))
        else:
            if key.startswith("pp"):  # the pipeline inside each node
                fn = _node_pipeline_fn(layout.mesh.pp, cfg, accumulation(key))
            else:
                mesh = build_device_mesh(layout.mesh.resolve(world), "cpu")
                fn = _step_fn(layout, mesh, cfg, dp="replica", chunks=accumulation(key))
            step_fns[key] = fn
            timers[key] = lambda reps, fn=fn: _timed(fn, reps, warmup=False)
            fn()  # warm-up: lazy init, first all-gathers
        times = timers[key](steps)
        out["local_s"][key] = median_everywhere(statistics.median(times))
        out["local_min_s"][key] = median_everywhere(min(times))
        dist.barrier()
    return out, timers


def _interleaved(timers: dict, keys: list[str], reps: int, blocks: int, steps: int, step,
                 cross_bytes, background: float) -> tuple[list[float], float, dict]:
    """A layout's ``steps`` timed steps in ``blocks`` blocks, the local shapes ``keys`` timed
    ``reps`` steps before each block and after the last (medians over all of them,
    everywhere): the calibration and the steps it predicts share the same minutes of
    machine load, as a planner calibrating right before it plans does, and a load swing
    hits both. Returns the step times, the cross-node bytes of the timed steps (Ray's
    background traffic taken out) and the local shapes' medians."""
    from benchmarks.planning_lab.measure import median_everywhere

    local: dict[str, list[float]] = {k: [] for k in keys}
    times: list[float] = []
    moved = 0.0
    for block in range(blocks + 1):
        for k in keys:
            local[k] += timers[k](reps)
        if block == blocks:
            break
        b0 = cross_bytes()
        got = _timed(step, steps // blocks + (block < steps % blocks), warmup=False)
        moved += cross_bytes() - b0 - background * sum(got)
        times += got
    return times, moved, {k: median_everywhere(statistics.median(v)) for k, v in local.items()}


def _counted(devices: list[str]):
    """A function that sums, over the nodes, the tx bytes of each of ``devices`` (local rank
    0 of each node reads its namespace's counters): every byte that crosses nodes leaves
    exactly one node's interface. Returns a tensor, one figure per device."""
    import ray.train
    import torch
    import torch.distributed as dist

    from benchmarks.workloads import read_counters

    local0 = ray.train.get_context().get_local_rank() == 0

    def count() -> torch.Tensor:
        mine = torch.tensor([float(read_counters(d)["tx_bytes"]) if local0 else 0.0
                             for d in devices], dtype=torch.float64)
        dist.all_reduce(mine)
        return mine
    return count


def _train(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    from ray_mesh.core.bootstrap import build_device_mesh
    from ray_mesh.core.layout import parse_layout

    cfg, world = config["model"], dist.get_world_size()
    from benchmarks.planning_lab.measure import (
        measure_cross,
        measure_pipeline_send,
        measure_unit_collectives,
    )

    calibration, local_timers = _calibration(config, world)
    per_node = config["per_node"]
    out = {**calibration, "layouts": {}, **measure_cross(per_node, config["reduce_bytes"]),
           "send_s": measure_pipeline_send(per_node, config["p2p_bytes"]),
           "unit_s": measure_unit_collectives(per_node, config["unit_bytes"], ("fp32", "bf16"))}

    # The tailnet interface (what the job sends) and the link under it (what the wire
    # carries: the same device on bare veth; WireGuard's UDP with its headers otherwise).
    cross_bytes = _counted(config["count_devices"])

    # Background traffic between nodes (Ray's own), per second, subtracted below.
    b0, t0 = cross_bytes(), time.perf_counter()
    time.sleep(2.0)
    background = (cross_bytes() - b0) / (time.perf_counter() - t0)
    out["background_bytes_per_s"] = background.tolist()
    out["trials"], out["trial_s"] = _trials(config, out["compute_s"])
    for raw in config["layouts"]:
        layout = parse_layout(raw["layout"])
        mesh = build_device_mesh(layout.mesh.resolve(world), "cpu", layout=layout)
        step = _step_fn(layout, mesh, cfg)
        step()  # warm-up outside the byte count
        times, moved, beside = _interleaved(local_timers, raw["local_keys"],
                                            config["around_reps"], config["blocks"],
                                            config["steps"], step, cross_bytes, background)
        out["layouts"][str(layout)] = {"measured_step_s": statistics.median(times),
                                        "step_s_all": times, "local_s_beside": beside,
                                        "cross_node_bytes_per_step": float(moved[0]) / len(times),
                                        "wire_bytes_per_step": float(moved[-1]) / len(times)}
    if dist.get_rank() == 0:
        write_result(config["out"], out)
    ray.train.report({"done": 1})


def _trials(config: dict, compute_s: float) -> tuple[list[dict], float]:
    """What ``mesh: auto`` with ``plan.step`` does at bring-up: the example's ``make_step``
    timed on every candidate, in the cost model's order (``compute_s`` as calibrated here,
    the link at its set rate), on this process group."""
    sys.path.insert(0, str(REPO / "examples"))
    import fsdp_tp_transformer as ex

    from ray_mesh.core.layout import parse_layout
    from ray_mesh.planning.cost import Links, ModelStats, Workload, predict
    from ray_mesh.planning.trial import run_trials

    stats, tokens = ModelStats(**config["stats"]), config["tokens"]
    links = Links(2, config["per_node"], float(config["set_mbit"]))
    layouts = sorted((parse_layout(x["layout"]) for x in config["layouts"]),
                     key=lambda x: predict(x, stats, links, Workload(tokens, compute_s)).step_s)
    t0 = time.perf_counter()
    trials = run_trials(layouts, ex.make_step, config["model"], steps=config["trial_steps"],
                        budget_s=config["trial_budget_s"])
    return [t.to_json() for t in trials], time.perf_counter() - t0


def _driver(args: dict) -> None:
    from ray_mesh import MeshConfig

    mesh = MeshConfig(mesh="fsdp", bringup_timeout_s=180, measure_links=True, link_probe_s=2.0)
    fit_netns_workers(_train, args, mesh, "slowlinks")


def _measured_links(addresses: list[str]) -> dict:
    """The rates the backend measured at bring-up (its cache file on this machine)."""
    from ray_mesh.raytrain.links import cached

    matrix = cached(addresses)
    if matrix is None:
        raise RuntimeError("the backend left no link measurement in its cache "
                           "(ray_mesh.raytrain.links.CACHE_FILE)")
    intra = min(x.mbit_s for x in matrix.links if x.a == x.b)
    return {"cross_mbit": matrix.cross_node_mbit(), "intra_mbit": intra,
            "links": matrix.to_json()}


def _trial_section(raw: dict, section: dict) -> dict:
    """mesh: auto's trials at this rate beside the layouts' own measured steps."""
    from ray_mesh.planning.trial import Trial, best_trial

    trials = [Trial.from_json(t) for t in raw["trials"]]
    best = best_trial(trials)
    fastest = section[section["fastest"]]["measured_step_s"]
    return {"pick": best and best.layout, "seconds": raw["trial_s"],
            "pick_vs_fastest": best and section[best.layout]["measured_step_s"] / fastest,
            "layouts": raw["trials"],
            "statistic": "trial: median of up to 3 steps after a warm-up, each the slowest "
                         "rank's; pick_vs_fastest: the pick's measured_step_s over the "
                         "fastest layout's"}


def measure(rates=RATES, steps: int = 3, model: dict | None = None,
            timeout_s: float = 1500.0, tunnel: str = "veth") -> dict:
    """Run every layout at every rate (``None`` or 0: unshaped); the figures for
    ``results.json['slowlinks']`` (bare veth, as recorded) or one tunnel's side of
    ``results.json['wireguard']`` (``benchmarks/wireguard.py``)."""
    from benchmarks.planning_lab.calibrate import Calibration, local_shapes, predict_calibrated
    from harness.netns import NetnsCluster, netns_unavailable_reason
    from ray_mesh.planning.cost import Links, ModelStats, Workload, candidates, predict

    if reason := netns_unavailable_reason(tunnel=tunnel):
        return {"status": f"not run: {reason}"}
    sys.path.insert(0, str(REPO / "examples"))
    import fsdp_tp_transformer as ex

    cfg = {**ex.DEFAULTS, **MODEL, **(model or {})}
    stats = ModelStats.from_module(ex.make_model(cfg), heads=cfg["heads"])
    tokens = cfg["batch_size"] * cfg["seq"]
    out: dict = {"model": {**stats.__dict__, "tokens_per_step": tokens}, "steps": steps,
                 "statistic": "median of the timed steps per layout; bytes: mean per step",
                 "prediction": "benchmarks.planning_lab.calibrate.predict_calibrated: one-node "
                               "calibration (nothing crossing nodes; local shapes timed "
                               "between each layout's blocks of steps) + the link priced by "
                               "measure_cross (tiny and large gloo all-reduces across "
                               "nodes, no model); probe_priced_step_s: the link priced from "
                               "the bring-up TCP probe instead; fit_calibration_step_s: local "
                               "shapes from the fit's start only; allreduce_priced_step_s: "
                               "without measure_pipeline_send (a pipeline's link priced from "
                               "the all-reduces) and measure_unit_collectives (tp_hsdp's "
                               "FSDP overhead with the in-node calls it does not run)"}
    with NetnsCluster([{"slot": 2}, {"slot": 2}], tunnel=tunnel) as cluster:
        out["tunnel"] = tunnel
        devices = ["tailscale0", cluster.link_iface]
        for mbit in rates:
            for node in cluster.nodes:
                if mbit:
                    cluster.shape_link(node.index, mbit)
                else:
                    cluster.unshape_link(node.index)
            # unshaped: the planner's candidates for the rate the probe measures at bring-up
            plan_mbit = float(mbit or 1000)
            layouts = candidates(stats, Links(2, 2, plan_mbit))
            path = str(cluster.root / f"slowlinks_{mbit}.json")
            links_set = Links(2, 2, plan_mbit)
            shapes = local_shapes(layouts, links_set)
            load_before = os.getloadavg()
            args = {"model": cfg, "steps": steps, "out": path, "per_node": 2,
                    "reduce_bytes": stats.params * 4 // 2,  # hsdp's replicate all-reduce
                    "p2p_bytes": tokens // 2 // 4 * stats.hidden * 4,  # pp: one microbatch
                    "unit_bytes": stats.params * 4 // (stats.layers + 1),  # one FSDP unit
                    "local_shapes": {k: str(x) for k, x in shapes.items()},
                    "tp_degrees": sorted({x.mesh.tp for x in layouts} - {1}),
                    "storage": str(cluster.root / "results"),
                    "stats": dict(stats.__dict__), "tokens": tokens, "set_mbit": plan_mbit,
                    "count_devices": devices,
                    "trial_steps": 3, "trial_budget_s": 120.0,
                    "around_reps": 3,  # local-shape steps before each block and after
                    "blocks": min(4, steps),  # the layout's steps in this many blocks
                    "layouts": [{"layout": str(x),
                                 "local_keys": sorted(local_shapes([x], links_set))}
                                for x in layouts]}
            run_head_driver(cluster, "benchmarks.slowlinks", args, timeout_s,
                            f"slowlinks driver at {mbit} Mbit/s")
            raw = read_result(path)
            rates_seen = _measured_links([n.ip for n in cluster.nodes])
            links = Links(2, 2, rates_seen["cross_mbit"], rates_seen["intra_mbit"],
                          collective_s=raw["collective_s"])
            work = Workload(tokens, raw["compute_s"],
                            tp_compute_s=tuple((int(t), float(c)) for t, c in raw["tp_compute_s"]))
            cross = {k: raw[k] for k in ("cross_call_s", "cross_Bps", "ring_Bps",
                                         "ring_call_s", "send_s", "unit_s")}
            cal = Calibration(raw["collective_s"], raw["gloo_Bps"], raw["p2p_s"], raw["local_s"],
                              **cross)
            cal_min = Calibration(raw["collective_s"], raw["gloo_Bps"], raw["p2p_s"],
                                  raw["local_min_s"], **cross)
            key = _rate_key(mbit)
            section: dict = {"set_mbit": mbit, "measured_links": rates_seen,
                             "compute_s": raw["compute_s"], "calibration": cal.to_json(),
                             "calibration_min_s": raw["local_min_s"],
                             "tp_compute_s": raw["tp_compute_s"],
                             "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]]}
            for lay in layouts:
                got = raw["layouts"][str(lay)]
                # the local shapes timed between this layout's blocks of steps (same load)
                beside = replace(cal, local_s={**cal.local_s, **got["local_s_beside"]})
                pred = predict_calibrated(lay, stats, links, work, beside)
                # the link priced from the TCP probe instead of measure_cross
                probe_priced = replace(beside, cross_call_s=0.0, cross_Bps=0.0, ring_Bps=0.0,
                                       ring_call_s=0.0, send_s=0.0, unit_s={})
                # without the pipeline's measured send and the in-node FSDP calls
                allreduce_priced = replace(beside, send_s=0.0, unit_s={})
                fastest = predict_calibrated(lay, stats, links, work, cal_min).step_s
                section[str(lay)] = {
                    "mesh": lay.dims, "predicted_step_s": pred.step_s,
                    "analytic_step_s": predict(lay, stats, links, work).step_s,
                    "probe_priced_step_s": predict_calibrated(lay, stats, links, work,
                                                              probe_priced).step_s,
                    "fit_calibration_step_s": predict_calibrated(lay, stats, links, work,
                                                                 cal).step_s,
                    "allreduce_priced_step_s": predict_calibrated(lay, stats, links, work,
                                                                  allreduce_priced).step_s,
                    "local_s_beside": got["local_s_beside"],
                    "step_s_all": got["step_s_all"],
                    # least-disturbed: the fastest calibration steps against the fastest
                    "predicted_min_step_s": fastest,
                    "step_error_min": fastest / min(got["step_s_all"]) - 1,
                    "measured_step_s": got["measured_step_s"],
                    "predicted_cross_node_bytes_per_step": pred.cross_node_bytes_per_step,
                    "cross_node_bytes_per_step": got["cross_node_bytes_per_step"],
                    "wire_bytes_per_step": got["wire_bytes_per_step"],
                    "step_error": pred.step_s / got["measured_step_s"] - 1}
            labels = [str(x) for x in layouts]
            section["pick"] = min(labels, key=lambda k: section[k]["predicted_step_s"])
            section["fastest"] = min(labels, key=lambda k: section[k]["measured_step_s"])
            section["pick_vs_fastest"] = (section[section["pick"]]["measured_step_s"]
                                          / section[section["fastest"]]["measured_step_s"])
            section["analytic_pick"] = min(labels, key=lambda k: section[k]["analytic_step_s"])
            section["trial"] = _trial_section(raw, section)
            out[key] = section
    return out


if __name__ == "__main__":
    _driver(json.loads(sys.argv[1]))
