"""Pool the paired step rounds of several ``run.py --only steps`` results into one table.

``python benchmarks/pool.py benchmarks/results_steps.json benchmarks/results_steps_repeat.json``

Each run's rounds are paired inside that run (window k of one launcher against window k of
another, taken minutes apart at most); pooling only puts more such pairs under one median.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.paired import RATIO_PAIRS, paired_ratios  # noqa: E402


def pooled(paths: list[str]) -> list[tuple[str, str, int, float, float, float]]:
    """(workload, "a / b", rounds, median, q1, q3) over every run that has both launchers."""
    windows: dict[tuple[str, str, str], list[float]] = {}  # (workload, a, b) -> a's, b's
    for path in paths:
        steps = json.loads(Path(path).read_text()).get("steps", {})
        for workload, w in steps.items():
            runs = w.get("runs", {})
            for a, b in RATIO_PAIRS:
                if a in runs and b in runs:
                    both = windows.setdefault((workload, a, b), ([], []))
                    both[0].extend(runs[a]["step_s_windows"])
                    both[1].extend(runs[b]["step_s_windows"])
    rows = []
    for (workload, a, b), (wa, wb) in windows.items():
        r = paired_ratios(wa, wb)
        rows.append((workload, f"{a} / {b}", r["rounds"], r["median_paired"], r["q1"], r["q3"]))
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
