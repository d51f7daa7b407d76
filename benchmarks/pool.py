"""Pool the paired step rounds of several ``run.py --only steps`` results into one table.

``python benchmarks/pool.py [--out benchmarks/results.json] RESULT.json ...``

Each run's rounds are paired inside that run (window k of one launcher against window k of
another, taken minutes apart at most); pooling only puts more such pairs under one median.
Beside the pooled median it reports each run's own median (the spread of repeat runs).
``--out`` merges the figures into that JSON under ``steps_pooled``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.paired import RATIO_PAIRS, paired_ratios  # noqa: E402

STATISTIC = ("median of paired per-round wall s/step ratios a[k] / b[k] over every round of "
             "every run, q1 and q3 of the same, n = rounds; per_run_median = each run's own "
             "median of its rounds")


def _windows(paths: list[str]) -> dict[tuple[str, str, str], list[tuple[str, list, list]]]:
    """(workload, a, b) -> [(run file, a's windows, b's windows)] for runs with both."""
    out: dict[tuple[str, str, str], list[tuple[str, list, list]]] = {}
    for path in paths:
        steps = json.loads(Path(path).read_text()).get("steps", {})
        for workload, w in steps.items():
            runs = w.get("runs", {})
            for a, b in RATIO_PAIRS:
                if a in runs and b in runs:
                    out.setdefault((workload, a, b), []).append(
                        (Path(path).name, runs[a]["step_s_windows"], runs[b]["step_s_windows"]))
    return out


def pooled_figures(paths: list[str]) -> list[dict]:
    """One dict per (workload, pair): pooled median [q1, q3], n, and every run's median."""
    rows = []
    for (workload, a, b), per_run in _windows(paths).items():
        r = paired_ratios([x for _, wa, _ in per_run for x in wa],
                          [x for _, _, wb in per_run for x in wb])
        runs = {name: paired_ratios(wa, wb)["median_paired"] for name, wa, wb in per_run}
        rows.append({"workload": workload, "pair": f"{a} / {b}", "rounds": r["rounds"],
                     "median_paired": r["median_paired"], "q1": r["q1"], "q3": r["q3"],
                     "per_run_median": runs,
                     "per_run_range": [min(runs.values()), max(runs.values())]})
    return rows


def pooled(paths: list[str]) -> list[tuple[str, str, int, float, float, float]]:
    """(workload, "a / b", rounds, median, q1, q3) over every run that has both launchers."""
    return [(r["workload"], r["pair"], r["rounds"], r["median_paired"], r["q1"], r["q3"])
            for r in pooled_figures(paths)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="run.py JSON files with a 'steps' section")
    p.add_argument("--out", help="merge the pooled figures into this JSON (steps_pooled)")
    args = p.parse_args(argv)
    rows = pooled_figures(args.results)
    print("| workload | wall ratio | rounds | paired median [q1, q3] | runs: own medians |")
    print("|---|---|---|---|---|")
    for r in rows:
        per_run = ", ".join(f"{v:.3f}" for v in r["per_run_median"].values())
        print(f"| {r['workload']} | {r['pair']} | {r['rounds']} | {r['median_paired']:.3f} "
              f"[{r['q1']:.3f}, {r['q3']:.3f}] | {len(r['per_run_median'])}: {per_run} |")
    if args.out:
        out = Path(args.out)
        doc = json.loads(out.read_text()) if out.exists() else {}
        doc["steps_pooled"] = {"statistic": STATISTIC, "inputs": [
            Path(x).name for x in args.results], "rows": rows}
        out.write_text(json.dumps(doc, indent=1))
        print(f"\nwrote steps_pooled into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
