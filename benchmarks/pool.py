"""Pool the paired step rounds of several ``run.py --only steps`` results into one table.

``python benchmarks/pool.py benchmarks/results_steps.json benchmarks/results_steps_repeat.json``

Each run's rounds are paired inside that run (window k of one launcher against window k of
another, taken minutes apart at most); pooling only puts more such pairs under one median.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

PAIRS = (("ray_mesh", "torchrun"), ("ray_plain", "torchrun"), ("ray_mesh", "ray_plain"),
         ("ray_mesh_nice15", "torchrun"), ("ray_mesh", "ray_mesh_nice15"))


def pooled(paths: list[str]) -> list[tuple[str, str, int, float, float, float]]:
    """(workload, "a / b", rounds, median, q1, q3) over every run that has both launchers."""
    ratios: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        steps = json.loads(Path(path).read_text()).get("steps", {})
        for workload, w in steps.items():
            runs = w.get("runs", {})
            for a, b in PAIRS:
                if a in runs and b in runs:
                    ratios.setdefault((workload, f"{a} / {b}"), []).extend(
                        x / y for x, y in zip(runs[a]["step_s_windows"],
                                              runs[b]["step_s_windows"], strict=True) if y)
    rows = []
    for (workload, pair), values in ratios.items():
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        rows.append((workload, pair, len(values), statistics.median(values), q1, q3))
    return rows


def main(paths: list[str]) -> int:
    if not paths:
        sys.exit(__doc__.strip().splitlines()[2])
    print("| workload | wall ratio | rounds | paired median [q1, q3] |")
    print("|---|---|---|---|")
    for workload, pair, n, med, q1, q3 in pooled(paths):
        print(f"| {workload} | {pair} | {n} | {med:.3f} [{q1:.3f}, {q3:.3f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
