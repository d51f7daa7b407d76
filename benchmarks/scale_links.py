"""Link measurement past one machine (issue 45): ``results.json["scale"]["links"]``.

At bring-up (``MeshConfig(measure_links=...)``, ``mesh: auto``, ``ray-mesh doctor``) one
process per node serves a bandwidth listener on its chosen address and the nodes send to
each other in rounds of disjoint pairs (``ray_mesh.network.links.measure_links``). This
benchmark runs that function, real listeners and real TCP transfers, with N simulated nodes
in this process: node i is a thread whose address is ``127.3.x.y`` (its own loopback
address) and ``run_on`` calls the node-side function in place. Two pair sets:

* ``all``: every pair, n-1 rounds (what the measurement did at every size, and still does
  up to 16 nodes);
* ``sampled``: the default past 16 nodes (``links.link_rounds``: 8 of those rounds drawn
  per run, each node against 8 others).

Figures per size and set:

* ``rounds``, ``transfers``: rounds of disjoint pairs (the within-node round included) and
  transfers in all (exact; counted without running where a size cannot run here);
* ``wall_s``: the measurement's elapsed time on loopback with each transfer capped at
  ``CAP_BYTES`` (a real link's transfer takes up to ``link_probe_s``, 1 s by default, so a
  real measurement takes about ``rounds`` seconds: ``wall_s_real_bound``);
* ``bytes``: sent in all at that cap; ``bytes_real_bound``: at the default cap (32 MiB per
  transfer, what a fast real link sends);
* ``judge_s``: the CPU time of reading the matrix as the run does (its table, the slow
  nodes, the relayed pairs, the exported series), a matrix of that set's links;
* ``cpu_s``: this process's CPU time for the whole measurement (every node's).

Each figure comes with the fitted growth exponent ``k`` of ``figure ~ n**k``. The 1-minute
load is recorded beside each size; a size measured at a load above 2 is published as None.

    python -m benchmarks.scale_links [--out FILE] [--sizes 8 32 128 512]
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.scale_preflight import settle  # noqa: E402
from benchmarks.scale_quorum import MAX_LOAD, growth_by_set, scale_main  # noqa: E402
from ray_mesh.network.links import (  # noqa: E402
    CHUNK,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_S,
    link_rounds,
    measure_links,
)
from ray_mesh.network.pairs import FULL_MESH_NODES  # noqa: E402

SIZES = (8, 32, 128, 512)
SETS = ("all", "sampled")
CAP_BYTES = 4 * CHUNK  # a few chunks per transfer on loopback (the receiver times first to last)
SIMULATE_ALL_MAX = 128  # the every-pair set past this is counted, not run (130,816 transfers)
FIGURES = ("rounds", "transfers", "wall_s", "bytes", "judge_s", "cpu_s")


def node_ip(i: int) -> str:
    return f"127.3.{i // 200}.{i % 200 + 1}"


def counted(n: int, which: str) -> dict:
    rounds = link_rounds(n, full_mesh_nodes=n if which == "all" else FULL_MESH_NODES) + [
        [(i, i) for i in range(n)]]
    transfers = sum(len(r) for r in rounds)
    return {"rounds": len(rounds), "transfers": transfers,
            "wall_s_real_bound": len(rounds) * DEFAULT_MAX_S,
            "bytes_real_bound": transfers * DEFAULT_MAX_BYTES}


def run_once(n: int, which: str) -> dict:
    addresses = [node_ip(i) for i in range(n)]
    sent = [0]
    lock = threading.Lock()

    def run_on(_i: int, fn, *args):  # noqa: ANN001, ANN202 - the node-side call, in place
        out = fn(*args)
        if fn.__name__ == "send_to":
            with lock:
                sent[0] += 1
        return out

    cpu0, t0 = time.process_time(), time.monotonic()
    matrix = measure_links(addresses, run_on, max_bytes=CAP_BYTES,
                           full_mesh_nodes=n if which == "all" else FULL_MESH_NODES)
    wall = time.monotonic() - t0
    j0 = time.process_time()
    text = matrix.format()
    matrix.exported()
    judge = time.process_time() - j0
    return {**counted(n, which), "wall_s": wall, "cpu_s": time.process_time() - cpu0,
            "judge_s": judge, "bytes": sent[0] * CAP_BYTES, "sent": sent[0],
            "verdict": matrix.verdict(), "table_lines": len(text.splitlines())}


def measure(sizes: tuple[int, ...] = SIZES) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(512 * 1024)
    rows = []
    for n in sizes:
        for which in SETS:
            if which == "all" and n <= FULL_MESH_NODES:
                continue  # the same set: the sampled one is every pair up to 16 nodes
            row = {"nodes": n, "set": which}
            if which == "all" and n > SIMULATE_ALL_MAX:
                rows.append({**row, **counted(n, which),
                             "skipped": f"counted, not run: every pair of {n} nodes"})
                print(f"{n:4d} nodes, {which}: {rows[-1]['transfers']} transfers in "
                      f"{rows[-1]['rounds']} rounds, counted", flush=True)
                continue
            settle()
            load = os.getloadavg()[0]
            got = run_once(n, which)
            after = os.getloadavg()[0]
            ok = max(load, after) <= MAX_LOAD
            timed = ("wall_s", "cpu_s", "judge_s")
            rows.append({**row, "load_1min": [round(load, 2), round(after, 2)],
                         **{k: (round(got[k], 3) if ok else None) for k in timed},
                         **{k: v for k, v in got.items() if k not in timed},
                         "recorded": {k: round(got[k], 3) for k in timed}})
            print(f"{n:4d} nodes, {which}: {got['transfers']} transfers in {got['rounds']} "
                  f"rounds, {got['wall_s']:.2f} s, {got['cpu_s']:.1f} CPU s, judged in "
                  f"{got['judge_s']:.3f} s (load {load:.2f} -> {after:.2f})", flush=True)
    growth = growth_by_set(rows, SETS, FIGURES)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"sizes": rows, "growth_exponent": growth,
            "targets": {"growth_exponent": "no figure faster than n log n"},
            "statistic": {"wall_s": "one measurement per size and set",
                          "judge_s": "one reading of the matrix per size and set"},
            "transport": "one process; nodes are threads on 127.3.x.y loopback addresses, "
                         f"each transfer capped at {CAP_BYTES} bytes",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    return scale_main(argv, __doc__, "links", measure, SIZES)


if __name__ == "__main__":
    raise SystemExit(main())
