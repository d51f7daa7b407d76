"""Per-step cost of ``ray_mesh.report`` (metrics every step) as a fraction of a step.

    python benchmarks/report_overhead.py [--windows 20] [--steps 50]

Runs in a Ray actor (where ``ray.util.metrics`` exports, as in a Train worker) the HSDP
example's toy model, one process, one optimizer step per step. Windows of ``--steps`` steps
alternate: plain steps, then the same steps each followed by
``ray_mesh.report({"step", "loss"}, every=N)`` with N larger than the window (the metrics
path only: a dict update per call, Ray metric writes every 2 s; the every-N-th
``ray.train.report`` is Ray Train's cost and needs a Train run, see README). Statistic:
the median over window pairs of (reporting window mean step time / plain window mean
step time - 1), written to ``benchmarks/results.json`` under
``observability.report_overhead``, with the plain step time and the cost of one call.
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


def _measure(windows: int, steps: int) -> dict:
    """Inside the actor: alternate plain and reporting windows; return the figures."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from hsdp import ToyModel, loss_fn, synthetic_batch

    from ray_mesh.observability import report as rep

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ToyModel()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    rec = rep.ReportRecorder(export=True)
    rep._recorder = rec  # this process's recorder exports to Ray's metrics pipeline

    def step(i: int) -> float:
        x, y = synthetic_batch(i, 0, 16, torch.device("cpu"))
        loss = loss_fn(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.item()

    for i in range(steps):  # warm-up
        step(i)
    ratios, plain_means = [], []
    i = 0
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps):
            step(i)
            i += 1
        plain = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(i)
            i += 1
            rep.report({"step": i, "loss": loss}, every=10**9)
        with_report = (time.perf_counter() - t0) / steps
        ratios.append(with_report / plain - 1)
        plain_means.append(plain)
    # One call alone, many times (the flushes every 2 s included).
    n = 20000
    t0 = time.perf_counter()
    for k in range(n):
        rep.report({"step": k, "loss": 0.5}, every=10**9)
    per_call = (time.perf_counter() - t0) / n
    return {"overhead_fraction_median": statistics.median(ratios),
            "overhead_fraction_windows": ratios,
            "plain_step_s_median": statistics.median(plain_means),
            "report_call_s_mean": per_call,
            "exported": rec.export,
            "windows": windows, "steps_per_window": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        actor = ray.remote(num_cpus=1)(_Runner).remote()
        res = ray.get(actor.run.remote(args.windows, args.steps), timeout=900)
    finally:
        ray.shutdown()
    res.update(statistic="median over window pairs of (mean step time with ray_mesh.report "
                         "every step / mean step time without) - 1",
               loadavg=os.getloadavg(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                           time.gmtime()))
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault("observability", {})["report_overhead"] = res
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"ray_mesh.report every step: {100 * res['overhead_fraction_median']:.2f}% of a "
          f"{1e3 * res['plain_step_s_median']:.2f} ms step (median of {args.windows} window "
          f"pairs); one call {1e6 * res['report_call_s_mean']:.1f} us; written to {args.out}")
    return 0


class _Runner:
    def run(self, windows: int, steps: int) -> dict:
        return _measure(windows, steps)


if __name__ == "__main__":
    sys.exit(main())
