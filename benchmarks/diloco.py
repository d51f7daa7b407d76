"""DiLoCo vs sync HSDP on shaped links: tokens/s, cross-node bytes and loss, same tokens.

The host starts the virtual Tailscale cluster (``harness/netns/``, 2 nodes x
2 workers) and runs this module as a driver in the head namespace: ONE Ray Train fit whose
train function runs every phase on the same process group, in turn:

- for each link rate (``None``: unshaped, the link-free ideal), each node's local rank 0
  caps its own ``tailscale0`` egress with ``tc ... tbf`` (so each direction of the node
  link carries at most the rate; the namespaces run as root);
- for each mode (``sync``: HSDP, the replicate dim all-reduces every step; ``diloco``:
  FSDP inside each node, DiLoCo every ``every`` steps with ``compress``), a fresh model from
  the same seed trains ``steps`` steps on the same global batches (so the same tokens); the
  wall time of the steps gives tokens/s, each node's ``tailscale0`` tx counters around them
  the cross-node bytes (minus Ray's idle traffic, measured first), and the mean loss over
  ``val_batches`` held-out batches the validation loss; per-step losses give the curves.

DiLoCo phases also check that the replicas are bitwise equal after every sync (outside the
timed region) and measure the cross-node bytes of inner steps alone (between syncs).

The model is a parameter: a module (file path, or a name in :data:`MODULES`) with
``DEFAULTS``, ``make_model(cfg)``, ``batch(step, cfg)`` and ``loss_fn(logits, targets)``, and
optionally ``place(model, mesh, dp)``, ``optimizer(params, cfg)``, ``lr_factor(step, cfg)``
and ``val_batch(i, cfg)``. The default is the LM job, ``benchmarks/diloco_lm.py``; ``toy``
is ``examples/fsdp_tp_transformer.py``. Figures go to ``results.json['diloco']`` via
``benchmarks/run.py --only diloco`` (keys ``diloco.<rate>``, the issue's targets under
``diloco.<rate>.checks``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import (
    REPO,
    fit_netns_workers,
    read_result,
    run_head_driver,
    write_result,
)

MODULES: dict[str, tuple[str, dict]] = {
    # the LM job: byte-level Llama on the stdlib's sources, held-out files for validation
    "lm": ("benchmarks/diloco_lm.py", {}),
    # the toy: a small transformer on a synthetic copy task (quick, but loss means little)
    "toy": ("examples/fsdp_tp_transformer.py",
            {"vocab": 256, "dim": 128, "heads": 4, "layers": 4, "ffn": 512, "seq": 64,
             "batch_size": 16, "lr": 0.003, "seed": 0, "mixed_precision": None}),
}
"""``measure(module=...)``: a name here (its file and overrides of its DEFAULTS) or a path."""


def rate_key(mbit: float | None) -> str:
    if mbit is None:
        return "unshaped"
    return f"{mbit / 1000:g}gbit" if mbit >= 1000 else f"{mbit:g}mbit"


_LOADED: dict[str, object] = {}


def _module(path: str):
    """The model module at ``path``, loaded once per process (its data caches live on)."""
    if path not in _LOADED:
        spec = importlib.util.spec_from_file_location("diloco_bench_model", REPO / path)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        _LOADED[path] = mod
    return _LOADED[path]


def _shape(mbit: float | None) -> None:
    """Cap (or uncap) this namespace's tailscale0 egress: run on one rank per node."""
    if mbit is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "tailscale0", "root"],
                       capture_output=True, check=False)
        return
    subprocess.run(["tc", "qdisc", "replace", "dev", "tailscale0", "root", "tbf", "rate",
                    f"{mbit:g}mbit", "burst", "64kb", "latency", "400ms"], check=True,
                   capture_output=True)


def run_phase(mode: str, config: dict, mesh, cross_bytes, node_bytes) -> dict:
    """Train one fresh model ``steps`` steps in ``mode``; figures for results.json.

    The measurement must not cross the link itself: steps are timed between barriers of a
    node's own ranks (``dp_shard``), and counters are read by each node alone
    (``node_bytes``) and summed after the run; only the phase's first and last readings
    (``cross_bytes``) and the replica check (its bytes and time left out) cross nodes.
    """
    import torch
    import torch.distributed as dist

    from ray_mesh.parallel import dp_mean, parallelize, shard_batch
    from ray_mesh.parallel.diloco import DiLoCo, DiLoCoConfig, replicas_equal

    ex = _module(config["module"])
    cfg = {**ex.DEFAULTS, **config["model"], "steps": config["steps"]}
    dp = "replica" if mode == "diloco" else "hsdp"
    model = (ex.place(ex.make_model(cfg), mesh, dp) if hasattr(ex, "place")
             else parallelize(ex.make_model(cfg), mesh, dp=dp))
    optim = (ex.optimizer(model.parameters(), cfg) if hasattr(ex, "optimizer")
             else torch.optim.AdamW(model.parameters(), lr=cfg["lr"]))
    sched = (torch.optim.lr_scheduler.LambdaLR(optim, lambda s: ex.lr_factor(s, cfg))
             if hasattr(ex, "lr_factor") else None)
    val_batch = getattr(ex, "val_batch", lambda i, c: ex.batch(100_000 + i, c))
    ex.batch(0, cfg)  # data read (once per process) before the clock starts
    dl = (DiLoCo(model, mesh, DiLoCoConfig(**config["replicate"])) if mode == "diloco"
          else None)
    rep_group, node = mesh.get_group("dp_replicate"), mesh.get_group("dp_shard")
    nodes = dist.get_world_size(rep_group)
    first = dist.get_group_rank(node, dist.get_rank()) == 0  # reads its node's counters
    h = dl.config.every if dl is not None else 0
    # replicas hold the same parameters after a sync only when it is the whole model and
    # lands at once; otherwise the global parameters are the ones to compare
    whole_model_syncs = dl is not None and dl.config.streaming == 1 and not dl.config.overlap
    losses, equal, elapsed = [], [], 0.0
    excluded = torch.zeros(2, dtype=torch.float64)  # this node's bytes, seconds left out
    inner = torch.zeros(2, dtype=torch.float64)  # this node's inner-step bytes, steps
    w0 = (0, 0.0, 0.0, 0.0)  # bytes, time, and what checks had left out, at its start
    b0 = cross_bytes()
    t_start = time.perf_counter()
    for step in range(config["steps"]):
        if h >= 3 and step % h == 1:  # inner steps only: from the 2nd of a block ...
            w0 = (node_bytes(), time.perf_counter(), *excluded.tolist())
        dist.barrier(group=node)
        t = time.perf_counter()
        x, y = shard_batch(ex.batch(step, cfg), mesh)
        loss = ex.loss_fn(model(x), y)
        loss.backward()
        if cfg.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optim.step()
        optim.zero_grad()
        if sched is not None:
            sched.step()
        synced = dl.step() if dl is not None else False
        if dl is not None and step == config["steps"] - 1:
            synced = dl.flush() or synced  # overlap: the last sync lands inside the clock
        dist.barrier(group=node)
        elapsed += time.perf_counter() - t
        losses.append(loss.detach())
        if h >= 3 and step % h == h - 2:  # ... to the one before the sync
            moved = node_bytes() - w0[0] - (float(excluded[0]) - w0[2])  # checks left out
            if first:  # the node's reader: its bytes, less its share of Ray's idle traffic
                took = time.perf_counter() - w0[1] - (float(excluded[1]) - w0[3])
                inner += torch.tensor([moved - config["background"] / nodes * took, h - 2])
        if synced:  # the check crosses nodes too: its bytes and time are left out
            c0, t0 = node_bytes(), time.perf_counter()
            equal.append(replicas_equal(model, rep_group) if whole_model_syncs
                         else dl.globals_equal())
            dist.barrier()  # both nodes done with the check before the reading
            excluded += torch.tensor([node_bytes() - c0, time.perf_counter() - t0])
    b1, counted_s = cross_bytes(), time.perf_counter() - t_start
    totals = torch.cat([excluded, inner])
    dist.all_reduce(totals)  # per node, summed (ranks other than a node's first read 0)
    left_out_b, left_out_s = float(totals[0]), float(totals[1]) / dist.get_world_size()
    moved = b1 - b0 - left_out_b - config["background"] * (counted_s - left_out_s)
    losses = dp_mean(torch.stack(losses), mesh).tolist()  # one collective, after the timing
    with torch.no_grad():
        val = [float(dp_mean(ex.loss_fn(model(xv), yv), mesh)) for xv, yv in
               (shard_batch(val_batch(i, cfg), mesh)
                for i in range(config["val_batches"]))]
    tokens = cfg["batch_size"] * cfg["seq"] * config["steps"]
    out = {"tokens_s": tokens / elapsed, "seconds": elapsed, "losses": losses,
           "val_loss": sum(val) / len(val), "cross_node_bytes_per_step": moved / len(losses)}
    if dl is not None:
        out.update(replicas_equal_after_syncs=equal, metrics=dl.metrics(),
                   replicas_compared="parameters" if whole_model_syncs else "global parameters",
                   inner_cross_node_bytes_per_step=float(totals[2]) / max(
                       float(totals[3]) / nodes, 1))
    return out


def _train(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    import ray_mesh
    from benchmarks.workloads import read_counters

    mesh = ray_mesh.get_mesh()
    world = dist.get_world_size()
    local0 = ray.train.get_context().get_local_rank() == 0

    def cross_bytes() -> int:
        # Every rank's collectives done first: local rank 1's replica group may still be
        # sending when local rank 0 reads its node's counter (bytes then land in the wrong
        # interval, e.g. the uncounted replicas_equal check into the counted steps).
        dist.barrier()
        mine = read_counters("tailscale0")["tx_bytes"] if local0 else 0
        total = [0] * world
        dist.all_gather_object(total, mine)
        return sum(total)

    def node_bytes() -> int:
        """This node's tailscale0 tx bytes (on its first rank; 0 elsewhere) after its own
        ranks' barrier: nothing crosses the link to read it."""
        dist.barrier(group=mesh.get_group("dp_shard"))
        return read_counters("tailscale0")["tx_bytes"] if local0 else 0

    b0, t0 = cross_bytes(), time.perf_counter()
    time.sleep(5.0)  # Ray's idle traffic: subtracted from every phase's bytes
    config["background"] = (cross_bytes() - b0) / (time.perf_counter() - t0)
    out: dict = {"background_bytes_per_s": config["background"], "phases": {}}
    try:
        for mbit in config["rates"]:
            if local0:
                _shape(mbit)
            dist.barrier()
            for mode in config["modes"]:
                out["phases"][f"{rate_key(mbit)}/{mode}"] = run_phase(mode, config, mesh,
                                                                      cross_bytes, node_bytes)
                if dist.get_rank() == 0:
                    print(f"diloco bench {rate_key(mbit)}/{mode}: "
                          f"{out['phases'][f'{rate_key(mbit)}/{mode}']['tokens_s']:.0f} "
                          "tokens/s", flush=True)
    finally:
        if local0:
            _shape(None)
    if dist.get_rank() == 0:
        write_result(config["out"], out)
    ray.train.report({"done": 1})


def _driver(args: dict) -> None:
    from ray_mesh import MeshConfig

    mesh = MeshConfig(mesh={"dp_replicate": "nodes", "dp_shard": -1}, bringup_timeout_s=240,
                      measure_links=False)
    fit_netns_workers(_train, args, mesh, "diloco")


def run_on_cluster(cluster, args: dict, timeout_s: float) -> dict:
    """Run the phases in ``args`` on a started NetnsCluster; the train function's figures."""
    args = {"storage": str(cluster.root / "results"),
            "out": str(cluster.root / f"diloco_{time.time_ns()}.json"), **args}
    run_head_driver(cluster, "benchmarks.diloco", args, timeout_s, "diloco driver")
    return read_result(args["out"])


def measure(rates=(100, 20), steps: int = 40, every: int = 10, compress: str = "int8",
            module: str = "lm", model: dict | None = None, val_batches: int = 4,
            outer_lr: float = 0.7, outer_momentum: float = 0.5, streaming: int = 1,
            overlap: int = 0, timeout_s: float = 1500.0) -> dict:
    """Both modes at every rate and unshaped; the figures for ``results.json['diloco']``."""
    from harness.netns import NetnsCluster, netns_unavailable_reason

    if reason := netns_unavailable_reason(tunnel="veth"):
        return {"status": f"not run: {reason}"}
    path, overrides = MODULES.get(module, (module, {}))
    replicate = {"every": every, "compress": compress, "outer_lr": outer_lr,
                 "outer_momentum": outer_momentum, "streaming": streaming, "overlap": overlap}
    args = {"rates": [None, *rates], "modes": ["sync", "diloco"], "steps": steps,
            "module": path, "model": {**overrides, **(model or {})}, "replicate": replicate,
            "val_batches": val_batches}
    t0, load0 = time.monotonic(), os.getloadavg()
    with NetnsCluster([{"slot": 2}, {"slot": 2}],
                      tunnel="veth") as cluster:  # bare veth, as the recorded figures
        raw = run_on_cluster(cluster, args, timeout_s)
    phases = raw["phases"]
    out: dict = {"module": path, "model": {**_module(path).DEFAULTS, **args["model"]},
                 "steps": steps, "replicate": replicate, "wall_s": time.monotonic() - t0,
                 "loadavg_start": load0, "loadavg_end": os.getloadavg(),
                 "background_bytes_per_s": raw["background_bytes_per_s"],
                 "title": f"{Path(path).stem}: sync HSDP vs DiLoCo, {steps} steps, 2 nodes "
                          f"x 2 workers",
                 "note": "2 nodes x 2 CPU workers on one 2-core machine shared with other "
                         "jobs (see loadavg_*): tokens/s are under that load; egress of each "
                         "node's tailscale0 capped with tc tbf"}
    free = phases["unshaped/sync"]
    for mbit in [None, *rates]:
        key = rate_key(mbit)
        s, d = phases[f"{key}/sync"], phases[f"{key}/diloco"]
        out[key] = {
            "every": every, "compress": compress,
            "unshaped_tokens_s": free["tokens_s"],
            "diloco_tokens_s": d["tokens_s"], "sync_tokens_s": s["tokens_s"],
            "diloco_val_loss": d["val_loss"], "sync_val_loss": s["val_loss"],
            "diloco_cross_node_bytes_per_step": d["cross_node_bytes_per_step"],
            "sync_cross_node_bytes_per_step": s["cross_node_bytes_per_step"],
            "diloco_inner_cross_node_bytes_per_step": d["inner_cross_node_bytes_per_step"],
            # what DiLoCo itself sends (its metrics: rank 0's payload x 4 ranks), no headers
            "diloco_payload_bytes_per_step": d["metrics"]["diloco/bytes_sent"] * 4 / steps,
            "diloco_replicas_equal_after_syncs": d["replicas_equal_after_syncs"],
            "diloco_replicas_compared": d["replicas_compared"],
            "diloco_losses": d["losses"], "sync_losses": s["losses"],
        }
        out[key]["checks"] = checks(out[key], every, compress)
    return out


def checks(sec: dict, every: int, compress: str) -> dict:
    """The issue's targets for one rate: each figure and whether it is met."""
    from ray_mesh.parallel.compress import wire_bytes

    ratio = wire_bytes(1 << 20, compress) / wire_bytes(1 << 20, "none")
    vs_free = sec["diloco_tokens_s"] / sec["unshaped_tokens_s"]
    vs_sync = sec["diloco_tokens_s"] / sec["sync_tokens_s"]
    rel = sec["diloco_val_loss"] / sec["sync_val_loss"] - 1
    bound = sec["sync_cross_node_bytes_per_step"] / every * ratio
    return {"diloco_over_unshaped": vs_free, "diloco_over_unshaped_met": vs_free >= 0.90,
            "diloco_over_sync": vs_sync, "diloco_over_sync_met": vs_sync >= 3.0,
            "val_loss_rel_diff": rel, "val_loss_met": abs(rel) <= 0.03,
            "compression_ratio": ratio, "bytes_bound_per_step": bound,
            "bytes_met": sec["diloco_cross_node_bytes_per_step"] <= bound}


def plot(results: dict, path: Path) -> Path:
    """Loss curves (sync vs DiLoCo, per step; identical tokens) into ``path`` (PNG or SVG)."""
    keys = [k for k, v in results.items() if isinstance(v, dict) and "sync_losses" in v]
    sec = results[keys[0]]
    curves = {f"sync HSDP (val loss {sec['sync_val_loss']:.3f})": sec["sync_losses"],
              f"DiLoCo H={sec['every']} {sec['compress']} (val loss "
              f"{sec['diloco_val_loss']:.3f})": sec["diloco_losses"]}
    title = str(results.get("title", "sync HSDP vs DiLoCo, 2 nodes x 2 workers"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = path.with_suffix(".svg")
        path.write_text(_svg(curves, title))
        return path
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=label)
    ax.set_xlabel("step (same tokens per step)")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return path


def _svg(curves: dict[str, list[float]], title: str = "", w: int = 640,
         h: int = 320) -> str:
    """Polylines on a y axis from the lowest loss to the highest after the first tenth of
    the steps (earlier points are clipped to the top: the start says little), 5 ticks."""
    lo = min(min(ys) for ys in curves.values())
    hi = max(max(ys[len(ys) // 10:]) for ys in curves.values())
    span, n = (hi - lo) or 1.0, max(len(ys) for ys in curves.values())
    left, right, top, bottom = 50, 15, 30, 35

    def xy(j: int, y: float) -> str:
        return (f"{left + (w - left - right) * j / max(n - 1, 1):.1f},"
                f"{h - bottom - (h - top - bottom) * (min(y, hi) - lo) / span:.1f}")

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             'font-family="sans-serif" font-size="11">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{left}" y="16" font-size="12">{title}</text>']
    for k in range(5):
        y = lo + span * k / 4
        yy = xy(0, y).split(",")[1]
        parts += [f'<line x1="{left}" x2="{w - right}" y1="{yy}" y2="{yy}" stroke="#ddd"/>',
                  f'<text x="4" y="{yy}">{y:.2f}</text>']
    for i, (label, ys) in enumerate(curves.items()):
        color = ("#1f77b4", "#d62728")[i % 2]
        pts = " ".join(xy(j, y) for j, y in enumerate(ys))
        parts += [f'<polyline fill="none" stroke="{color}" points="{pts}"/>',
                  f'<text x="{w - 300}" y="{top + 16 + 14 * i}" fill="{color}">{label}</text>']
    parts.append(f'<text x="{left}" y="{h - 8}">training loss (nats) per step, steps 1..{n}, '
                 f'the same tokens in both runs (clipped at {hi:.2f})</text></svg>')
    return "\n".join(parts)


if __name__ == "__main__":
    _driver(json.loads(sys.argv[1]))
