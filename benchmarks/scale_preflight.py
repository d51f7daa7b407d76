"""The pre-flight's pair checks past one machine (issue 45): ``results.json["scale"]["preflight"]``.

Before the first process group, every node listens on its chosen address and connects to its
peers' listeners and to rank 0's rendezvous port, all under one 20 s bound
(``ray_mesh.raytrain.preflight.run_preflight``). This benchmark runs that function, the real
steps on real sockets, with N simulated nodes in this process: node i is a thread pool slot
whose address is ``127.2.x.y`` (its own loopback address), its interface table a fake that
holds only that address (``ray_mesh.network.probe.local_interfaces`` patched per call), and
the executor the threads the unit tests use. Two pair sets:

* ``all``: every ordered pair, n(n-1) connections (what the pre-flight did at every size, and
  still does up to 16 nodes);
* ``bounded``: the default past 16 nodes (``ray_mesh.network.pairs.check_pairs``: the head
  both ways, the ring both ways, ceil(log2 n) partners, about n(log2 n + 3)).

Figures per size and pair set:

* ``wall_s``: the pre-flight's own elapsed time (``report.elapsed_s``); on one machine it
  holds every node's work (a real cluster spreads it over the nodes);
* ``connections``: connects tried (node pairs, plus one per node to the rendezvous port);
  ``max_out``, ``max_in``: the most a node made, and the most a node's listeners were asked
  (node 0's rendezvous port included); ``max_out_other``, ``max_in_other``: the same over
  the nodes other than the head;
* ``ok``: whether the pre-flight passed; ``problems``: how many it reported (on a healthy
  loopback every one is the check's own doing); ``turned_away``: connections the listeners'
  gate turned away (evicted by a crowd, expired);
* ``cpu_s``: this process's CPU time for the whole pre-flight (every node's).

A size that cannot run here (the ``all`` set's n(n-1) sockets over the file limit, or more
than :data:`SIMULATE_MAX` nodes' threads in one process) has its connections counted from
the same pair set (exact), and the reason instead of a time. Each figure comes with the
fitted growth exponent ``k`` of ``figure ~ n**k``. The 1-minute load is recorded beside
each size; a size measured at a load above 2 is published as None.

    python -m benchmarks.scale_preflight [--out FILE] [--sizes 8 32 128 512]
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import resource
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray_mesh.network.probe as probe  # noqa: E402
from benchmarks.scale_quorum import MAX_LOAD, growth_by_set, scale_main  # noqa: E402
from ray_mesh.network.pairs import all_pairs, check_pairs, finger_count  # noqa: E402
from ray_mesh.network.report import NodeTarget  # noqa: E402
from ray_mesh.raytrain.preflight import Outcome, run_preflight  # noqa: E402

SIZES = (8, 32, 128, 512)
TIMEOUT_S = 20.0  # the pre-flight's default bound
SIMULATE_MAX = 128  # nodes simulated on sockets; past it the connections are counted
SETS = ("all", "bounded")
FIGURES = ("wall_s", "connections", "max_out", "max_in", "max_out_other", "max_in_other",
           "cpu_s")
_node = threading.local()


def node_ip(i: int) -> str:
    return f"127.2.{i // 200}.{i % 200 + 1}"


def _interfaces() -> dict[str, list[str]]:
    """The simulated node's interface table: its own loopback address only."""
    return {"lo": [getattr(_node, "ip", "127.0.0.1")]}


class NodeThreads:
    """Each node's calls on a thread of its own, as each node is its own machine."""

    def __init__(self, nodes: int) -> None:
        self.pool = cf.ThreadPoolExecutor(nodes)

    def submit(self, node: int, fn, *args):  # noqa: ANN001, ANN201
        def call():  # noqa: ANN202
            _node.ip = node_ip(node)
            return fn(*args)
        return self.pool.submit(call)

    def wait(self, handles, timeout_s: float) -> list[Outcome]:  # noqa: ANN001
        done, _ = cf.wait(handles, timeout=max(timeout_s, 0))
        return [Outcome("timeout") if h not in done else
                Outcome("error", repr(h.exception())) if h.exception() else
                Outcome("ok", h.result()) for h in handles]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def fits(nodes: int, pairs: int) -> str | None:
    """Why ``pairs`` connections at once cannot run in this process (None: they can)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (pairs + nodes) + 4 * nodes  # both ends of each, the listeners, some slack
    if need > soft:
        return (f"{pairs + nodes} connections at once need ~{need} file descriptors in one "
                f"process; the limit here is {soft}")
    return None


def counted(nodes: int, which: str) -> dict:
    """The connections of a pre-flight of ``nodes``, counted from the pair set the code
    uses (exact whatever the machine): in all, the most a node makes, the most a listener
    is asked (node 0's two listeners together: its own and the rendezvous port)."""
    pairs = all_pairs(nodes) if which == "all" else check_pairs(nodes, seed=0)
    out = Counter(i for i, _ in pairs)
    into = Counter(j for _, j in pairs)
    into[0] += nodes  # every node's connect to the rendezvous port
    return {"connections": len(pairs) + nodes, "pairs": len(pairs), **_most(out, into)}


def _most(out: Counter, into: Counter) -> dict:
    """The most connects a node makes (its rendezvous connect included) and a node's
    listeners are asked, of all nodes and of the nodes other than the head (node 0)."""
    others = [i for i in set(out) | set(into) if i != 0]
    return {"max_out": max(out.values(), default=0) + 1, "max_in": max(into.values()),
            "max_out_other": max((out[i] for i in others), default=0) + 1,
            "max_in_other": max((into[i] for i in others), default=0)}


def run_once(nodes: int, which: str) -> dict:
    pairs = all_pairs(nodes) if which == "all" else None  # None: the default set
    why = fits(nodes, nodes * (nodes - 1)) if which == "all" else None
    if nodes > SIMULATE_MAX:
        why = (f"not simulated: {nodes} nodes are ~{nodes * (finger_count(nodes) + 6)} threads "
               f"in one process on this 2-core machine (a try at 512 took the 1-minute load "
               f"to 366); connections counted from the pair set")
    if why:
        return {"skipped": why, **counted(nodes, which)}
    with socket.socket() as s:
        s.bind((node_ip(0), 0))
        rdv = s.getsockname()[1]
    targets = [NodeTarget(node_ip(i), "auto", f"sim{i}") for i in range(nodes)]
    executor = NodeThreads(nodes)
    real = probe.local_interfaces
    probe.local_interfaces = _interfaces
    c0 = time.process_time()
    try:
        report = run_preflight(executor, targets, rendezvous_port=rdv, timeout_s=TIMEOUT_S,
                               pairs=pairs)
    finally:
        probe.local_interfaces = real
        executor.close()
    cpu = time.process_time() - c0
    out = Counter(i for i, _ in report.matrix)
    into = Counter(j for _, j in report.matrix)
    into[0] += len(report.rendezvous)  # node 0's two listeners: its own, the rendezvous
    gates = list(report.gates.values())
    return {"wall_s": report.elapsed_s, "cpu_s": cpu,
            "connections": len(report.matrix) + len(report.rendezvous),
            "pairs": len(report.pairs),
            **_most(out, into),
            "ok": report.ok, "problems": len(report.problems),
            "first_problems": [p[:300] for p in report.problems[:3]],
            "failed_connects": sum(1 for r in [*report.matrix.values(),
                                               *report.rendezvous.values()] if not r.ok),
            "turned_away": sum(g.turned_away for g in gates),
            "evicted": sum(g.evicted for g in gates),
            "report_kb": len(report.format()) / 1024}


def settle(below: float = 1.5, most_s: float = 180.0) -> None:
    """Wait (up to ``most_s``) for the 1-minute load to fall below ``below``: a run starts
    hundreds of threads at once, which the load average counts, and the next size would
    read the last one's."""
    end = time.monotonic() + most_s
    while os.getloadavg()[0] >= below and time.monotonic() < end:
        time.sleep(5)


def measure(sizes: tuple[int, ...] = SIZES) -> dict:
    threading.stack_size(512 * 1024)  # thousands of probe threads in one process
    probe.node_versions()  # torch's import, once: each node has its own already loaded
    rows = []
    for n in sizes:
        for which in SETS:
            if which == "all" and n <= 16:
                continue  # the same set: the bounded one is all pairs up to 16 nodes
            if n <= SIMULATE_MAX:
                settle()
            load = os.getloadavg()[0]
            got = run_once(n, which)
            after = os.getloadavg()[0]
            ok = max(load, after) <= MAX_LOAD
            row = {"nodes": n, "set": which, "load_1min": [round(load, 2), round(after, 2)]}
            if "skipped" in got:
                rows.append({**row, **got})
                print(f"{n:4d} nodes, {which}: {got['connections']} connections (max out "
                      f"{got['max_out']}, max in {got['max_in']}), counted; {got['skipped']}",
                      flush=True)
                continue
            rows.append({**row,
                         **{k: (round(got[k], 3) if ok else None) for k in ("wall_s", "cpu_s")},
                         **{k: got[k] for k in got if k not in ("wall_s", "cpu_s")},
                         "recorded": {k: round(got[k], 3) for k in ("wall_s", "cpu_s")}})
            print(f"{n:4d} nodes, {which}: {got['connections']} connections (max out "
                  f"{got['max_out']}, max in {got['max_in']}) in {got['wall_s']:.2f} s, "
                  f"{got['cpu_s']:.1f} CPU s; {'passed' if got['ok'] else 'FAILED'} "
                  f"({got['problems']} problem(s), {got['failed_connects']} failed connects, "
                  f"{got['evicted']} evicted) (load {load:.2f} -> {after:.2f})", flush=True)
    growth = growth_by_set(rows, SETS, FIGURES)
    return {"sizes": rows, "growth_exponent": growth,
            "targets": {"wall_s": f"<= {TIMEOUT_S:g} (the pre-flight's bound)",
                        "growth_exponent": "connections no faster than n log n"},
            "statistic": {"wall_s": "one pre-flight per size and set"},
            "transport": "one process; nodes are threads on 127.2.x.y loopback addresses",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    return scale_main(argv, __doc__, "preflight", measure, SIZES)


if __name__ == "__main__":
    raise SystemExit(main())
