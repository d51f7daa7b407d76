"""Unequal boxes on the virtual cluster: one replica group per node, segments sized by speed.

Three namespace nodes (``harness/netns``, bare veth links) with 2, 2 and 1 ``slot`` (the
workers a node has room for), each under a CPU quota (cgroup v1 CFS, ``NetnsCluster
(node_cpus=...)``): 0.6, 0.6 and 0.2 cores: the last box has one device at two thirds of
the others' per-device speed. A quota is a cap, not a reservation: the boxes share the
machine's two cores, so a box is measured beside the others (see ``alone`` below). A fourth
node, the head, has no slot and no quota: it holds the driver and Ray's control plane (GCS,
the coordinator, each group's Ray Train controller), as a user's head node would.
The train function is ``harness/replica_train.py`` (an MLP with ``work`` extra matmuls per
sample, so a step is CPU work; FSDP inside each group).
Every run is one ``fit_replica_groups`` driven from the head namespace
(``benchmarks/replica_groups.py``'s driver), each group pinned to its node:

* ``speed``: ``groups="auto"``: the three groups (``dp_shard=2``, ``dp_shard=2``,
  ``dp_shard=1``; full tensors cross between them), ``shares="speed"``;
* ``alone_0`` / ``alone_1`` / ``alone_2``: one group alone on each box, each step at the
  batch that box trained on in ``speed`` (its mean share): what each box does by itself at
  the same work per step (a boundary costs a round trip to the coordinator whatever the
  batch, so a box alone at a smaller batch would look slower than it is, and the sum of the
  three could fall below what they do together). The three runs go at the same time, each
  its own ``fit_replica_groups`` with nothing shared: the boxes are one machine's cores, and
  a box measured while the others were idle borrowed their share of it (at the same batch a
  fast box computed a step in 0.41 s alone, 0.47 s beside the others, median), which
  separate machines would not lend;
* ``equal``: the same groups, equal segments (everyone at the slowest box's pace); the
  same total batch per step as ``speed``, so it is also the loss reference;
* ``leave_out``: nodes 0 and 1 only, equal segments (a uniform mesh leaves the odd node out).

Every run above goes in two modes: ``sync`` (a boundary, i.e. a gradient average, every
step) and ``diloco`` (``diloco={"every": 4}``: a boundary closes a round of 4 inner steps on
each group's own, so a faster group takes larger inner batches; the outer average weighs
each pseudo-gradient by its samples). Their figures are ``results.json['mixed_nodes']``'s
top level (``sync``) and ``['mixed_nodes']['diloco']``.

Throughput is samples committed per second of training, from the groups' step logs (rank 0
writes each committed step with its time): the samples of steps ``WARMUP + 1`` to the last
over the time between those steps' commits (bring-up excluded). Figures:
``throughput_of_sum`` (``speed`` over the sum of the ``alone`` runs; target >= 0.9),
``vs_leave_out`` (``speed`` over ``leave_out``), ``vs_slowest_pace`` (``speed`` over
``equal``) and ``final_loss_rel_diff`` (``speed``'s held-out loss against ``equal``'s;
target <= 0.03).

    python -m benchmarks.mixed_nodes            # writes results.json["mixed_nodes"]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO  # noqa: E402
from harness import replica_check as rc  # noqa: E402

TRAIN = str(REPO / "harness" / "replica_train.py") + ":train_loop"
STATISTIC = ("single run per configuration (the three alone runs side by side): samples/s "
             "of steps after the first {warmup} (from the step logs' commit times), no "
             "repeats, no spread")
WARMUP = 4


def _throughput(logs_dir: Path) -> tuple[float, int]:
    """Samples per second over the committed steps after WARMUP, all groups together."""
    logs = rc.read(logs_dir)
    per_step: dict[int, tuple[float, int]] = {}
    for rows in logs.values():
        for r in rows:
            t, n = per_step.get(r["step"], (0.0, 0))
            per_step[r["step"]] = (max(t, r["t"]), n + sum(c for _, c in r["ranges"]))
    steps = sorted(s for s in per_step if s > WARMUP)
    if len(steps) < 2:
        raise RuntimeError(f"only {len(steps)} committed steps after warm-up in {logs_dir}")
    samples = sum(per_step[s][1] for s in steps[1:])
    return samples / (per_step[steps[-1]][0] - per_step[steps[0]][0]), len(steps)


def cycle_parts(logs_dir: Path) -> dict[str, dict[str, float]]:
    """Per group, the medians over its steps after WARMUP of where a step's time went: its
    compute, its own part of the boundary (the commit less the quorum wait) and the wait
    for the other groups (``harness/replica_train.py`` logs each)."""
    import statistics

    out = {}
    for gid, rows in rc.read(logs_dir).items():
        late = [r for r in rows if r["step"] > WARMUP and "compute_s" in r]
        if late:
            out[str(gid)] = {
                "compute_s": statistics.median(r["compute_s"] for r in late),
                "own_boundary_s": statistics.median(r["commit_s"] - r["waited_s"] for r in late),
                "wait_s": statistics.median(r["waited_s"] for r in late)}
    return out


def mean_shares(logs_dir: Path) -> dict[str, float]:
    """Per group, its mean samples per committed step after WARMUP."""
    out = {}
    for gid, rows in rc.read(logs_dir).items():
        late = [sum(n for _, n in r["ranges"]) for r in rows if r["step"] > WARMUP]
        out[str(gid)] = sum(late) / len(late) if late else 0.0
    return out


SLOTS = (2, 2, 1)  # the boxes (nodes 1-3; node 0 is the head, without slots)
QUOTAS = {1: 0.6, 2: 0.6, 3: 0.2}  # cores per box
# Per mode: boundaries, samples per group per boundary, the train function's settings. DiLoCo
# moves the same samples per step as sync (32 per group per inner step, 4 inner steps).
MODES = {"sync": {"steps": 60, "segment": 32, "train": {}},
         "diloco": {"steps": 20, "segment": 128,
                    "train": {"diloco": {"every": 4}, "lr": 0.01}}}


def _run(cluster, name: str, root: Path, groups, *, shares: str, steps: int, segment: int,
         work: int, train: dict) -> dict:
    from benchmarks.replica_groups import run_on_cluster

    logs_dir = root / name / "logs"
    args = {"groups": groups, "workers": None, "steps": steps, "segment_samples": segment,
            "shares": shares, "name": f"mixed-{name}",
            "config": {"log_dir": str(logs_dir), "work": work, **train},
            "storage": str(root / "runs"), "resources_per_worker": {"CPU": 1, "slot": 1},
            "env": {}}
    t0 = time.monotonic()
    raw = run_on_cluster(cluster, args, root / name, timeout_s=900)
    thr, counted = _throughput(logs_dir)
    finals = [rows[-1] for rows in rc.finals(logs_dir).values()]
    shares_seen = {**mean_shares(logs_dir),
                   "speeds": {str(g): s["samples_per_s"]
                              for g, s in raw["status"].get("shares", {}).items()}}
    print(f"[mixed_nodes] {name}: {thr:.1f} samples/s over {counted} steps, "
          f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"samples_per_s": thr, "steps_counted": counted,
            "eval_loss": min(f["eval_loss"] for f in finals),
            "eval_loss_spread": max(f["eval_loss"] for f in finals)
            - min(f["eval_loss"] for f in finals),
            "layouts": raw["status"].get("layouts", {}), "cycle": cycle_parts(logs_dir),
            "shares": shares_seen, "wall_s": time.monotonic() - t0}


def _mode(cluster, root: Path, mode: str, work: int) -> dict:
    """Every run of one mode, then its figures."""
    m = MODES[mode]
    kw = {"steps": m["steps"], "segment": m["segment"], "work": work, "train": m["train"]}
    spec = [{"mesh": {"dp_shard": n}, "node": cluster.nodes[i + 1].ip}
            for i, n in enumerate(SLOTS)]
    r: dict = {}
    r["speed"] = _run(cluster, f"{mode}-speed", root, "auto", shares="speed", **kw)
    # each box alone, at the batch it trains in `speed`; the three at once (see above)
    at = {i: max(n, round(r["speed"]["shares"][str(i)] / n) * n) for i, n in enumerate(SLOTS)}
    with ThreadPoolExecutor(len(SLOTS)) as pool:
        alone = {i: pool.submit(_run, cluster, f"{mode}-alone_{i}", root, [spec[i]],
                                shares="equal", **{**kw, "segment": at[i]}) for i in at}
        for i, future in alone.items():
            r[f"alone_{i}"] = {**future.result(), "segment": at[i]}
    r["equal"] = _run(cluster, f"{mode}-equal", root, "auto", shares="equal", **kw)
    r["leave_out"] = _run(cluster, f"{mode}-leave_out", root, spec[:2], shares="equal", **kw)
    speed = r["speed"]["samples_per_s"]
    return {"runs": r,
            "throughput_of_sum": speed / sum(r[f"alone_{i}"]["samples_per_s"]
                                             for i in range(len(SLOTS))),
            "vs_leave_out": speed / r["leave_out"]["samples_per_s"],
            "vs_slowest_pace": speed / r["equal"]["samples_per_s"],
            "final_loss_rel_diff": abs(r["speed"]["eval_loss"] - r["equal"]["eval_loss"])
            / r["equal"]["eval_loss"]}


def measure(work: int = 100, modes: tuple[str, ...] = ("sync", "diloco")) -> dict:
    """Every run above, then the figures for ``results.json['mixed_nodes']``."""
    from harness.netns import NetnsCluster, netns_unavailable_reason
    from harness.netns.cpu import cpu_quota_unavailable_reason

    if reason := netns_unavailable_reason(tunnel="veth") or cpu_quota_unavailable_reason():
        return {"status": f"not run: {reason}"}
    load0 = os.getloadavg()
    sync, dl = MODES["sync"], MODES["diloco"]
    out: dict = {"statistic": STATISTIC.format(warmup=WARMUP),
                 "setup": (f"virtual cluster: 3 namespace nodes with {'+'.join(map(str, SLOTS))} "
                           f"slots under CPU quotas of {', '.join(map(str, QUOTAS.values()))} "
                           f"cores (cgroup v1) and a head without slots or quota, bare veth "
                           f"links; one replica group per box, FSDP inside; {work} 128x128 "
                           f"matmuls per sample. sync: {sync['steps']} steps, "
                           f"{sync['segment']} samples per group per step; diloco: "
                           f"{dl['steps']} rounds of {dl['train']['diloco']['every']} inner "
                           f"steps, {dl['segment']} samples per group per round")}
    root = Path(tempfile.mkdtemp(prefix="mixed_nodes_"))
    with NetnsCluster([{}] + [{"slot": n} for n in SLOTS], tunnel="veth", start_attempts=4,
                      ray_start_timeout_s=180, node_cpus=QUOTAS) as cluster:
        for mode in modes:
            figures = _mode(cluster, root, mode, work)
            if mode == "sync":
                out.update(figures)
            else:
                out[mode] = figures
    out.update(loadavg_start=load0, loadavg_end=os.getloadavg())
    return out


def cycle_text(run: dict) -> str:
    """A run's :func:`cycle_parts` as RESULTS.md shows them: compute / own boundary / wait."""
    return ", ".join(f"g{g}: {c['compute_s']:.2f} / {c['own_boundary_s']:.2f} / "
                     f"{c['wait_s']:.2f}" for g, c in run.get("cycle", {}).items())


def markdown(m: dict) -> str:
    """The RESULTS.md section for ``results.json['mixed_nodes']``."""
    def shares(run: dict) -> str:
        return ", ".join(f"g{g}: {n:.1f}" for g, n in run["shares"].items() if g != "speeds")

    def table(f: dict) -> str:
        rows = "\n".join(f"| `{name}` | {run['samples_per_s']:.1f} | {run['eval_loss']:.4f} | "
                         f"{shares(run)} | {cycle_text(run)} |" for name, run in f["runs"].items())
        return (f"| figure | value | target |\n|---|---|---|\n"
                f"| `throughput_of_sum` | {f['throughput_of_sum']:.3f} | >= 0.9 |\n"
                f"| `vs_leave_out` | {f['vs_leave_out']:.3f} | > 1 |\n"
                f"| `vs_slowest_pace` | {f['vs_slowest_pace']:.3f} | > 1 |\n"
                f"| `final_loss_rel_diff` | {f['final_loss_rel_diff']:.4f} | <= 0.03 |\n\n"
                f"| run | samples/s | held-out loss | mean samples per boundary per group | "
                f"median s per step: compute / own boundary / wait for others |\n"
                f"|---|---|---|---|---|\n{rows}\n")

    text = (f"## Mixed nodes: shares by speed\n\n{m['setup']}. Statistic: {m['statistic']}."
            f"\n\n### sync (a gradient average every step)\n\n{table(m)}")
    if "diloco" in m:
        text += f"\n### diloco (an outer average every 4 inner steps)\n\n{table(m['diloco'])}"
    return text


def main() -> int:
    results_path = REPO / "benchmarks" / "results.json"
    m = measure()
    if "status" in m:
        print(m["status"], file=sys.stderr)
        return 1
    results = json.loads(results_path.read_text())
    results["mixed_nodes"] = m
    results_path.write_text(json.dumps(results, indent=1, default=str))
    print(markdown(m))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
