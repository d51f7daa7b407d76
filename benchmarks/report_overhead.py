"""Per-report cost of ray_mesh's bookkeeping (``ray_mesh.report``) as a fraction of a step.

    python benchmarks/report_overhead.py [--steps 2000]

Runs in a Ray actor (where ``ray.util.metrics`` exports, as in a Train worker) the HSDP
example's toy model (a small step: the worst case for a fixed per-step cost), one process,
one optimizer step per step. What is added per step is what ``ray_mesh.report`` does
before handing the dict to ``ray.train.report``, ``ReportRecorder.observe({"step",
"loss"})`` (a dict update per call, Ray metric writes every 2 s; no progress line: that is
rank 0's, at most one a second); the report itself is Ray Train's cost, see docs/monitoring.md.
Statistic ``overhead_fraction``: mean cost of one call over 20000 calls / median plain step
time. Cross-check ``paired_median_fraction``: steps alternate with and without a report, the
ratio of their medians - 1 (on a loaded host it is noise of a few %). Written to
``benchmarks/results.json`` under ``observability.report_overhead`` (the fraction of a step)
and ``observability.report_overhead_detail`` (every figure and the statistic).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results.json"


def _measure(steps: int) -> dict:
    """Inside the actor: alternate plain and reporting steps; return the figures."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hsdp import ToyModel, loss_fn, synthetic_batch

    from ray_mesh.observability.export import Exporter
    from ray_mesh.observability.report import ReportRecorder

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ToyModel()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    rec = ReportRecorder(Exporter(loud=True))  # exports to Ray's metrics pipeline

    def step(i: int) -> float:
        x, y = synthetic_batch(i, 0, 16, torch.device("cpu"))
        loss = loss_fn(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.item()

    for i in range(50):  # warm-up
        step(i)
    # Steps alternate plain / with a report, so load from elsewhere hits both arms alike;
    # medians of per-step times are robust to the odd preempted step.
    plain, with_report = [], []
    for i in range(50, 50 + 2 * steps):
        t0 = time.perf_counter()
        loss = step(i)
        if i % 2:
            rec.observe({"step": i, "loss": loss})
            with_report.append(time.perf_counter() - t0)
        else:
            plain.append(time.perf_counter() - t0)
    # The added work itself: one call, many times (the flushes every 2 s included).
    n = 20000
    t0 = time.perf_counter()
    for k in range(n):
        rec.observe({"step": k, "loss": 0.5})
    per_call = (time.perf_counter() - t0) / n
    step_s = statistics.median(plain)
    return {"overhead_fraction": per_call / step_s,
            "paired_median_fraction": statistics.median(with_report) / step_s - 1,
            "plain_step_s_median": step_s,
            "report_call_s_mean": per_call,
            "exported": rec.exporter.enabled,
            "steps_per_arm": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps per arm")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        actor = ray.remote(num_cpus=1)(_Runner).remote()
        res = ray.get(actor.run.remote(args.steps), timeout=900)
    finally:
        ray.shutdown()
    res.update(statistic="overhead_fraction: mean time of one ReportRecorder.observe (20000 "
                         "calls, Ray metric writes every 2 s included) / median time of a "
                         "plain step; paired_median_fraction: median step time with a report "
                         "/ median without - 1, steps alternating (noisy on a loaded host)",
               loadavg=os.getloadavg(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                           time.gmtime()))
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    obs = data.setdefault("observability", {})
    obs["report_overhead"] = res["overhead_fraction"]  # the key: a fraction of a step
    obs["report_overhead_detail"] = res
    args.out.write_text(json.dumps(data, indent=1, default=str))  # as benchmarks/run.py
    print(f"report bookkeeping every step: one call {1e6 * res['report_call_s_mean']:.1f} us = "
          f"{100 * res['overhead_fraction']:.2f}% of a {1e3 * res['plain_step_s_median']:.2f} "
          f"ms step; paired medians {100 * res['paired_median_fraction']:+.2f}%; written to "
          f"{args.out}")
    return 0


class _Runner:
    def run(self, steps: int) -> dict:
        return _measure(steps)


if __name__ == "__main__":
    sys.exit(main())
