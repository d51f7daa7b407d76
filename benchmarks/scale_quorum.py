"""The replica groups' coordinator past one machine (issue 45): ``results.json["scale"]["quorum"]``.

The coordinator actor of a run (``ray_mesh/raytrain/replica_coordinator.py``) is one
process that every rank of every group calls: a heartbeat every 0.5 s from each rank, and
an arrival at each step boundary. Both go into :class:`ray_mesh.replicas.quorum.Quorum`,
which this benchmark drives in-process at 8, 32, 128 and 512 groups of 2 ranks each (the
real class, its real locks and books; what it leaves out is Ray's actor-call transport,
whose cost per call does not depend on the number of groups):

* ``heartbeat_cores``: the coordinator's CPU for one second of heartbeats, i.e. process CPU
  time per beat (beats delivered back to back, round-robin over every rank of every group,
  the quorum's clock set to when each would come: ``groups`` x 2 ranks at one per 0.5 s)
  times those beats a second. Target: within one core at 512 groups.
* ``decision_ms``: one boundary's decision, the call of the last group to arrive (every
  other group already waiting), which forms the quorum, settles the sample books and splits
  the samples by speed (``shares="speed"``) for every member; the median of ``repeats``
  boundaries after a first one. Target: within 50 ms at 512 groups.
* ``boundary_cpu_ms``: the coordinator's CPU for a whole boundary: every group's arrival
  (each call looks at the others), the decision and its collection; the median of
  ``repeats``. What one step costs the coordinator, whatever the step's length.

Each figure comes with the fitted growth exponent ``k`` of ``figure ~ groups**k`` (least
squares on the logs; 1 is linear) over the sizes measured. The machine's 1-minute load is
recorded beside each size; a size measured at a load above 2 is published as None.
Statistic: ``heartbeat_cores`` one pass of ``seconds`` worth of beats; ``decision_ms`` and
``boundary_cpu_ms`` the median of ``repeats``.

    python -m benchmarks.scale_quorum [--out FILE] [--sizes 8 32 128 512]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_mesh.replicas.quorum import Quorum  # noqa: E402

SIZES = (8, 32, 128, 512)
RANKS = 2          # ranks per group
BEAT_S = 0.5       # ray_mesh.replicas.group's heartbeat interval
SECONDS = 2.0      # of heartbeats, per size
REPEATS = 5        # boundaries timed per size (after a first one)
SEGMENT = 8
MAX_LOAD = 2.0     # 1-minute load above which a size's figures are not published
OUT = Path(__file__).resolve().parent / "results.json"
FIGURES = ("heartbeat_cores", "decision_ms", "boundary_cpu_ms")


def _quorum(groups: int, clock=time.monotonic) -> Quorum:
    q = Quorum(segment_samples=SEGMENT, total_steps=10**9, expected_groups=groups,
               shares="speed", clock=clock)
    for g in range(groups):
        q.register(g, f"a{g}", RANKS)
    return q


def heartbeat_cores(groups: int, seconds: float = SECONDS) -> float:
    """Cores the coordinator spends on ``seconds`` of every rank's heartbeats, per second."""
    per_s = groups * RANKS / BEAT_S
    n = max(1, int(per_s * seconds))
    now = [0.0]  # the quorum's clock: each beat 1/per_s after the one before, as they come
    q = _quorum(groups, clock=lambda: now[0])
    t0 = time.process_time()
    for i in range(n):
        g, r = i % groups, (i // groups) % RANKS
        now[0] = i / per_s
        q.beat(g, f"a{g}", r)
    return (time.process_time() - t0) / n * per_s


def decision_ms(groups: int, repeats: int = REPEATS) -> tuple[float, float]:
    """Medians over boundaries of ``groups`` groups: milliseconds of the last arrival's call
    (the decision), and the coordinator's CPU milliseconds for the whole boundary (every
    arrival's call, the decision and its collection)."""
    q = _quorum(groups)
    held: dict[int, list] = {g: [] for g in range(groups)}
    step, times, cpu = 0, [], []
    for boundary in range(repeats + 1):
        c0 = time.process_time()
        for g in range(groups - 1):
            assert q.arrive(g, f"a{g}", step, held[g], False, busy_s=0.5, fixed_s=0.1,
                            wait_s=0) is None
        t0 = time.perf_counter()
        last = groups - 1
        d = q.arrive(last, f"a{last}", step, held[last], False, busy_s=0.5, fixed_s=0.1,
                     wait_s=0)
        if boundary:
            times.append(time.perf_counter() - t0)
        assert d is not None and len(d.members) == groups, d
        held[last] = d.ranges
        for g in range(groups - 1):  # their decisions are made: collect them
            held[g] = q.await_decision(g, f"a{g}", wait_s=0).ranges
        if boundary:
            cpu.append(time.process_time() - c0)
        step = d.step + 1
    return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3


def exponent(sizes: list[int], values: list[float | None]) -> float | None:
    """k of ``value ~ size**k`` by least squares on the logs (None with under 2 points)."""
    pts = [(math.log(s), math.log(v)) for s, v in zip(sizes, values, strict=True)
           if v is not None and v > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 2) if sxx else None


def growth_by_set(rows: list[dict], sets: tuple[str, ...], figures: tuple[str, ...],
                  same_up_to: int = 16) -> dict:
    """Each pair set's growth exponent per figure, over its rows and the rows up to
    ``same_up_to`` nodes, where every set is the same one (every pair)."""
    growth = {}
    for which in sets:
        mine = [r for r in rows if r["set"] == which or r["nodes"] <= same_up_to]
        ns = [r["nodes"] for r in mine]
        growth[which] = {k: exponent(ns, [r.get(k) for r in mine]) for k in figures}
    return growth


def measure(sizes: tuple[int, ...] = SIZES) -> dict:
    rows = []
    for n in sizes:
        load = os.getloadavg()[0]
        hb, (dm, bc) = heartbeat_cores(n), decision_ms(n)
        after = os.getloadavg()[0]
        ok = max(load, after) <= MAX_LOAD
        got = {"heartbeat_cores": hb, "decision_ms": dm, "boundary_cpu_ms": bc}
        rows.append({"groups": n, "ranks_per_group": RANKS,
                     **{k: round(v, 4) if ok else None for k, v in got.items()},
                     "recorded": got, "load_1min": [round(load, 2), round(after, 2)]})
        print(f"{n:4d} groups: heartbeats {hb:.3f} cores, decision {dm:.2f} ms, boundary "
              f"{bc:.1f} CPU ms (load {load:.2f} -> {after:.2f})", flush=True)
    ns = [r["groups"] for r in rows]
    return {"sizes": rows,
            "growth_exponent": {k: exponent(ns, [r[k] for r in rows]) for k in FIGURES},
            "targets": {"heartbeat_cores": "<= 1 at 512 groups",
                        "decision_ms": "<= 50 at 512 groups",
                        "growth_exponent": "no figure faster than n log n"},
            "statistic": {"heartbeat_cores": f"one pass of {SECONDS:g} s of beats",
                          "decision_ms": f"median of {REPEATS} boundaries",
                          "boundary_cpu_ms": f"median of {REPEATS} boundaries"},
            "transport": "in-process Quorum; Ray's actor calls not included",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def scale_main(argv: list[str] | None, doc: str, key: str, measure_fn, sizes) -> int:
    """A scale benchmark's command line: measure at ``--sizes`` and write the figures to
    ``results.json["scale"][key]`` (``--out``), the other sections kept."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--sizes", type=int, nargs="+", default=list(sizes))
    args = p.parse_args(argv)
    result = measure_fn(tuple(args.sizes))
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault("scale", {})[key] = result
    out.write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(result["growth_exponent"]), f"wrote {out} ['scale']['{key}']")
    return 0


def main(argv: list[str] | None = None) -> int:
    return scale_main(argv, __doc__, "quorum", measure, SIZES)


if __name__ == "__main__":
    raise SystemExit(main())
