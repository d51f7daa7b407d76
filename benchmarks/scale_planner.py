"""The planner past one machine (issue 45): ``results.json["scale"]["planner"]``.

``mesh="auto"`` and ``ray-mesh plan`` rank every candidate layout for the cluster
(``ray_mesh.planning.cost.rank_layouts``: ddp, fsdp, hsdp, tp_hsdp, pp, tp_pp, each in its
gradient precisions, DiLoCo where asked) on the driver, before any worker starts. This
benchmark times that search, the real function on the real cost model, at 8, 32, 128 and
512 nodes of 8 ranks each, for models of 125M, 1B and 8B parameters (their layer counts and
widths; the model's size decides which tp degrees and pipeline stages are candidates):

* ``search_ms``: one ranking, the median of ``repeats`` (after a first, untimed one);
* ``candidates``: how many layouts were predicted;
* ``cluster_ms``: ``ray-mesh plan``'s choice of nodes before it (``plan_cluster``: the
  nodes grouped by accelerator and slots, an HSDP mesh planned on every worker of the
  chosen set, ranks checked node-aligned), on ``nodes`` records as ``ray.nodes()`` gives
  them, the median of ``repeats``.

Each figure comes with the fitted growth exponent ``k`` of ``figure ~ nodes**k`` (least
squares on the logs; 1 is linear). The machine's 1-minute load is recorded beside each
size; a size measured at a load above 2 is published as None.

    python -m benchmarks.scale_planner [--out FILE] [--sizes 8 32 128 512]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.scale_quorum import MAX_LOAD, exponent, scale_main  # noqa: E402
from ray_mesh.planning.cluster import NodeInfo, plan_cluster  # noqa: E402
from ray_mesh.planning.cost import Links, ModelStats, Workload, rank_layouts  # noqa: E402

SIZES = (8, 32, 128, 512)
PER_NODE = 8
REPEATS = 5
OUT = Path(__file__).resolve().parent / "results.json"
# Llama-style shapes: (parameters, layers, hidden, heads)
MODELS = {"125M": (125_000_000, 12, 768, 12), "1B": (1_200_000_000, 16, 2048, 32),
          "8B": (8_000_000_000, 32, 4096, 32)}


def search_ms(nodes: int, model: str, repeats: int = REPEATS) -> tuple[float, int]:
    """(median ms of one ranking, candidates ranked) on ``nodes`` x :data:`PER_NODE`."""
    params, layers, hidden, heads = MODELS[model]
    stats = ModelStats(params=params, layers=layers, hidden=hidden, heads=heads)
    links = Links(nodes, PER_NODE, 1000.0, intra_mbit=400_000, backend="nccl")
    work = Workload(tokens=4096 * nodes * PER_NODE, compute_s=1.0 * nodes * PER_NODE)
    ranked = rank_layouts(stats, links, work)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rank_layouts(stats, links, work)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), len(ranked)


def cluster_ms(nodes: int, repeats: int = REPEATS) -> float:
    """Median ms of ``plan_cluster`` over ``nodes`` nodes of :data:`PER_NODE` GPUs."""
    infos = [NodeInfo(node_id=f"{i:056x}", ip=f"100.64.{i // 250}.{i % 250 + 1}",
                      gpus=PER_NODE, cpus=4 * PER_NODE, accelerator="H100", is_head=i == 0)
             for i in range(nodes)]
    plan_cluster(infos, "hsdp", resource="GPU")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan_cluster(infos, "hsdp", resource="GPU")
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(sizes: tuple[int, ...] = SIZES) -> dict:
    rows = []
    for n in sizes:
        load = os.getloadavg()[0]
        got = {m: search_ms(n, m) for m in MODELS}
        nodes_ms = cluster_ms(n)
        after = os.getloadavg()[0]
        ok = max(load, after) <= MAX_LOAD
        rows.append({"nodes": n, "ranks_per_node": PER_NODE,
                     "search_ms": {m: round(ms, 3) if ok else None
                                   for m, (ms, _) in got.items()},
                     "candidates": {m: c for m, (_, c) in got.items()},
                     "cluster_ms": round(nodes_ms, 3) if ok else None,
                     "recorded_ms": {**{m: round(ms, 3) for m, (ms, _) in got.items()},
                                     "cluster": round(nodes_ms, 3)},
                     "load_1min": [round(load, 2), round(after, 2)]})
        print(f"{n:4d} nodes: " + ", ".join(f"{m} {ms:.2f} ms ({c} layouts)"
                                            for m, (ms, c) in got.items())
              + f", nodes chosen in {nodes_ms:.1f} ms (load {load:.2f} -> {after:.2f})",
              flush=True)
    ns = [r["nodes"] for r in rows]
    return {"sizes": rows,
            "growth_exponent": {
                **{f"search_ms_{m}": exponent(ns, [r["search_ms"][m] for r in rows])
                   for m in MODELS},
                "cluster_ms": exponent(ns, [r["cluster_ms"] for r in rows])},
            "targets": {"growth_exponent": "no figure faster than n log n"},
            "statistic": {"search_ms": f"median of {REPEATS} rankings after a first one",
                          "cluster_ms": f"median of {REPEATS} plans after a first one"},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    return scale_main(argv, __doc__, "planner", measure, SIZES)


if __name__ == "__main__":
    raise SystemExit(main())
