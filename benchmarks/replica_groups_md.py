"""The RESULTS.md section of ``results.json['replica_groups']``: the figures and the loss
curves of the clean and failure runs per mode (``python -m benchmarks.replica_groups_md``
prints it; it is pasted below RESULTS.md's hand-written notes mark by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _f(v, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def section(sec: dict, every: int = 10) -> str:
    lines = ["| mode | survivors' max step gap, s | survivor steps lost | rejoin, s | "
             "rejoin bytes (group) | final loss clean / failure | rel. diff |",
             "|---|---|---|---|---|---|---|"]
    curves = []
    for mode in ("hsdp", "diloco"):
        m = sec.get(mode)
        if not m or m.get("status") != "ok":
            lines.append(f"| {mode} | {(m or {}).get('status', 'not run')[:200]} |||||| ")
            continue
        lines.append(
            f"| {mode} | {_f(m['survivor_max_step_gap_s'], '.2f')} | "
            f"{m['survivor_steps_lost']} | {_f(m['rejoin_s'], '.1f')} | "
            f"{_f(m['rejoin_bytes'], ',.0f')} | {m['final_eval_loss_clean']:.6f} / "
            f"{m['final_eval_loss_failure']:.6f} | {m['final_loss_rel_diff']:.2e} |")
        clean, fail = m["runs"]["clean"]["loss_curve"], m["runs"]["failure"]["loss_curve"]
        last = max(int(s) for s in clean)
        steps = sorted({1, *range(every, last + 1, every), last})
        s = m["setup"]
        curves += ["", f"**{mode}** ({s['boundary']} per step; the training loss each group's "
                   f"rank 0 logged at that step, mean over the groups that logged it; "
                   f"node killed after step {s['killed_at_step']}):", "",
                   "| step | clean: loss (groups) | failure: loss (groups) |", "|---|---|---|"]
        for st in steps:
            c, f = clean.get(str(st)), fail.get(str(st))
            curves.append(f"| {st} | " + " | ".join(
                "-" if x is None else f"{x['loss']:.4f} ({x['groups']})" for x in (c, f)) + " |")
    return "\n".join(lines + curves)


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else REPO / "benchmarks" / "results.json"
    print(section(json.loads(Path(path).read_text())["replica_groups"]))
