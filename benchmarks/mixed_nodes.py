"""Unequal boxes: replica groups whose segments are sized to their speed.

Local Ray, two replica groups of one CPU worker each (``harness/replica_train.py``, an MLP
with ``work`` extra matmuls per sample, so a step is CPU work), each group's training
thread pinned to its own core, and another process spinning on the second core all along:
that core's group gets about half of it, a box at half speed. Runs, each one
``fit_replica_groups`` (synchronous HSDP-style steps, one boundary per step):

* ``alone_fast`` / ``alone_slow``: one group alone on the fast / the slowed core: what each
  box does by itself;
* ``equal``: both groups, ``segment_samples`` each per step (today's default: everyone at
  the slowest box's pace);
* ``speed``: both groups, ``shares="speed"`` (the same total per step, split by measured
  speed);
* ``uniform``: both groups, equal shares, no spinning process: the reference for the loss
  (same total batch per step, identical boxes).

Throughput is samples committed per second of training, from the groups' step logs (rank 0
writes each committed step with its time): the samples of steps ``WARMUP + 1`` to the last
over the time between those steps' commits (bring-up excluded). Figures:
``throughput_of_sum`` (``speed`` over ``alone_fast + alone_slow``; target >= 0.9),
``vs_leave_out`` (``speed`` over ``alone_fast``: leaving the slow box out),
``vs_slowest_pace`` (``speed`` over ``equal``) and ``final_loss_rel_diff`` (``speed``'s
held-out loss against ``uniform``'s; target <= 0.03).

    python -m benchmarks.mixed_nodes            # writes results.json["mixed_nodes"]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO  # noqa: E402
from harness import replica_check as rc  # noqa: E402

TRAIN = str(REPO / "harness" / "replica_train.py") + ":train_loop"
STATISTIC = ("single run per configuration: samples/s of steps after the first "
             "{warmup} (from the step logs' commit times), no repeats, no spread")
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


def mean_shares(logs_dir: Path) -> dict[str, float]:
    """Per group, its mean samples per committed step after WARMUP."""
    out = {}
    for gid, rows in rc.read(logs_dir).items():
        late = [sum(n for _, n in r["ranges"]) for r in rows if r["step"] > WARMUP]
        out[str(gid)] = sum(late) / len(late) if late else 0.0
    return out


def _run(name: str, root: Path, *, groups: int, pins: list[int], shares: str,
         steps: int, segment: int, work: int) -> dict:
    from ray_mesh.cli.job import load_function
    from ray_mesh.raytrain.replica_groups import fit_replica_groups

    logs_dir = root / name / "logs"
    logs_dir.mkdir(parents=True)
    t0 = time.monotonic()
    res = fit_replica_groups(
        load_function(TRAIN), groups=groups, workers_per_group=1, total_steps=steps,
        segment_samples=segment, shares=shares, name=f"mixed-{name}",
        config={"log_dir": str(logs_dir), "work": work,
                "pin_cpu": {str(g): core for g, core in enumerate(pins)}},
        storage_path=str(root / "runs"), resources_per_worker={"CPU": 1})
    thr, counted = _throughput(logs_dir)
    finals = [rows[-1] for rows in rc.finals(logs_dir).values()]
    shares_seen = {**mean_shares(logs_dir),
                   "speeds": {str(g): s["samples_per_s"]
                              for g, s in res.status.get("shares", {}).items()}}
    print(f"[mixed_nodes] {name}: {thr:.1f} samples/s over {counted} steps, "
          f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"samples_per_s": thr, "steps_counted": counted,
            "eval_loss": min(f["eval_loss"] for f in finals),
            "eval_loss_spread": max(f["eval_loss"] for f in finals)
            - min(f["eval_loss"] for f in finals),
            "shares": shares_seen, "wall_s": time.monotonic() - t0}


def measure(steps: int = 40, segment: int = 16, work: int = 200) -> dict:
    """Every run above, then the figures for ``results.json['mixed_nodes']``."""
    import ray

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return {"status": "not run: needs 2 cores (one per group)"}
    fast, slow = cores[0], cores[1]
    load0 = os.getloadavg()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    out: dict = {"statistic": STATISTIC.format(warmup=WARMUP),
                 "setup": (f"local Ray, 2 replica groups x 1 CPU worker, each pinned to its "
                           f"own core; a spinning process on core {slow} all along (the "
                           f"slowed box); {steps} steps, {segment} samples per group per "
                           f"step, {work} 128x128 matmuls per sample"),
                 "runs": {}}
    kw = {"steps": steps, "segment": segment, "work": work}
    root = Path(tempfile.mkdtemp(prefix="mixed_nodes_"))
    try:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=lambda: os.sched_setaffinity(0, {slow}))
        try:
            runs = out["runs"]
            runs["alone_fast"] = _run("alone_fast", root, groups=1, pins=[fast],
                                      shares="equal", **kw)
            runs["alone_slow"] = _run("alone_slow", root, groups=1, pins=[slow],
                                      shares="equal", **kw)
            runs["equal"] = _run("equal", root, groups=2, pins=[fast, slow], shares="equal",
                                 **kw)
            runs["speed"] = _run("speed", root, groups=2, pins=[fast, slow], shares="speed",
                                 **kw)
        finally:
            hog.kill()
            hog.wait()
        runs["uniform"] = _run("uniform", root, groups=2, pins=[fast, slow], shares="equal",
                               **kw)
    finally:
        ray.shutdown()
    r = out["runs"]
    speed = r["speed"]["samples_per_s"]
    out.update(
        throughput_of_sum=speed / (r["alone_fast"]["samples_per_s"]
                                   + r["alone_slow"]["samples_per_s"]),
        vs_leave_out=speed / r["alone_fast"]["samples_per_s"],
        vs_slowest_pace=speed / r["equal"]["samples_per_s"],
        final_loss_rel_diff=abs(r["speed"]["eval_loss"] - r["uniform"]["eval_loss"])
        / r["uniform"]["eval_loss"],
        loadavg_start=load0, loadavg_end=os.getloadavg())
    return out


def markdown(m: dict) -> str:
    """The RESULTS.md section for ``results.json['mixed_nodes']``."""
    def shares(run: dict) -> str:
        return ", ".join(f"g{g}: {n:.1f}" for g, n in run["shares"].items() if g != "speeds")

    rows = "\n".join(f"| `{name}` | {run['samples_per_s']:.1f} | {run['eval_loss']:.4f} | "
                     f"{shares(run)} |" for name, run in m["runs"].items())
    return (f"## Mixed nodes: shares by speed\n\n{m['setup']}. Statistic: {m['statistic']}."
            f"\n\n| figure | value | target |\n|---|---|---|\n"
            f"| `throughput_of_sum` | {m['throughput_of_sum']:.3f} | >= 0.9 |\n"
            f"| `vs_leave_out` | {m['vs_leave_out']:.3f} | > 1 |\n"
            f"| `vs_slowest_pace` | {m['vs_slowest_pace']:.3f} | > 1 |\n"
            f"| `final_loss_rel_diff` | {m['final_loss_rel_diff']:.4f} | <= 0.03 |\n\n"
            f"| run | samples/s | held-out loss | mean samples per step per group |\n"
            f"|---|---|---|---|\n{rows}\n")


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
