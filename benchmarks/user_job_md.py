"""How ``results.json["user_job"]`` reads: its rows in ``benchmarks/run.py``'s table, its
section of RESULTS.md (replaced in place below the hand-written notes mark, or added at the
end), and the summary ``python -m benchmarks.user_job`` prints. A figure the load rule
refused (``benchmarks/user_job_figures.py``) shows as ``invalid`` with its reason, never as
a number."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADING = "## The user's whole job (`benchmarks/user_job.py`)"
TARGETS = {"throughput_of_sum_sync": ">= 0.85", "throughput_of_sum_sync_int8": ">= 0.85",
           "throughput_of_sum_diloco": ">= 0.92",
           "survivor_max_step_gap_s": "< 10", "survivor_steps_lost": "0",
           "rejoin_s": "report", "final_loss_rel_diff": "<= 0.03",
           "goodput_vs_restart": ">= 1.3", "goodput_vs_restart_from_launch": "report",
           "survivor_max_step_gap_s_diloco": "< 10", "survivor_steps_lost_diloco": "0",
           "rejoin_s_diloco": "report", "final_loss_rel_diff_diloco": "<= 0.03",
           "goodput_vs_restart_diloco": ">= 1.3"}
WHAT = {
    "throughput_of_sum_sync": "sync: whole job tokens/s / sum of each box alone",
    "throughput_of_sum_sync_int8": "sync, gradients between groups as int8: the same ratio",
    "throughput_of_sum_diloco": "diloco: whole job tokens/s / sum of each box alone",
    "survivor_max_step_gap_s": "laptop dropped: survivors' longest step gap, s",
    "survivor_steps_lost": "laptop dropped: survivor steps lost",
    "rejoin_s": "laptop dropped: first drop -> its group's next step, s (Ray back included)",
    "final_loss_rel_diff": "laptop dropped: held-out loss vs the uninterrupted run, rel.",
    "goodput_vs_restart": "useful tokens/h, replica groups / one mesh with checkpoint-restart "
                          "(the same training window)",
    "goodput_vs_restart_from_launch": "the same, each from its launch (bring-up included)",
    # the same drops with the groups in DiLoCo (``drops.mode: diloco``; the survivors' pause
    # read from their inner steps)
    "survivor_max_step_gap_s_diloco": "DiLoCo, laptop dropped: survivors' longest step gap, s",
    "survivor_steps_lost_diloco": "DiLoCo, laptop dropped: survivor steps lost",
    "rejoin_s_diloco": "DiLoCo, laptop dropped: first drop -> its group's next step, s",
    "final_loss_rel_diff_diloco": "DiLoCo, laptop dropped: held-out loss vs the uninterrupted "
                                  "DiLoCo run, rel.",
    "goodput_vs_restart_diloco": "DiLoCo: useful tokens/h, replica groups / one mesh with "
                                 "checkpoint-restart (each from its launch)",
}


def value(u: dict, name: str, full: bool = False) -> str:
    """A figure as shown: a refused one as ``invalid (why)``, the first reason only unless
    ``full``."""
    if name in u.get("invalid", {}):
        why = u["invalid"][name]
        return f"invalid ({why if full else why.split('; ')[0]})"
    v = u.get(name)
    if v is None:
        return "-"
    if name.startswith("goodput_vs_restart") and u.get(f"{name}_is_lower_bound"):
        return f">= {v:.3g} (the one mesh did not finish)"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def rows(u: dict) -> list[tuple[str, str, str, str]]:
    """``(section, figure, value, target)`` rows for ``benchmarks/report.table``."""
    out = []
    if u.get("status", "ok") != "ok":
        out.append(("k user job", "status", str(u["status"])[:300], ""))
    return out + [("k user job", f"{WHAT[n]} ({statistic(u, n)})", value(u, n), TARGETS[n])
                  for n in WHAT if n in u or n in u.get("invalid", {})]


def statistic(u: dict, name: str) -> str:
    """What a figure is: ``single run``, or ``median of N runs`` where several full runs of
    the same code and setting measured it (``u["medians"][name]``: each run's value)."""
    runs = u.get("medians", {}).get(name)
    return f"median of {len(runs['values'])} runs" if runs else "single run"


def _load(run: dict) -> str:
    ld = run.get("load", {})
    others = ld.get("others_runnable_mean")
    return (f"{ld.get('loadavg_1m_start', 0):.1f} / {ld.get('loadavg_1m_end', 0):.1f} / "
            f"{ld.get('loadavg_1m_max', 0):.1f}; "
            + ("-" if others is None else f"{others:.2f}"))


def _f(v: Any, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def _list3(values: list) -> str:
    return ", ".join(_f(v, ".3g") for v in values)


def _list(values: list) -> str:
    return "[" + ", ".join(_f(v, ".1f") for v in values) + "]"


def markdown(u: dict) -> str:
    if "runs" not in u:
        return f"{HEADING}\n\nNot measured: {u['status'][:500]}\n"
    s = u["settings"]
    d = s.get("drops") or {}
    lines = [HEADING, "",
             f"`python -m benchmarks.user_job` ({u['started']}, {u['wall_s']:.0f} s in all; "
             f"every run in `results.json[\"user_job\"][\"runs\"]`). The job of "
             f"`docs/lab_job.md` on its virtual cluster (3 boxes over WireGuard, 2 + 2 + 1 "
             f"CPU workers, Ray processes under CPU quotas in every run, cores per box "
             f"{u.get('box_quotas_cores')}; a moto bucket on the "
             f"head). Statistic: {u['statistic']}. The laptop dropped {d.get('first_s', '-')} "
             f"s after the run's first step and every {d.get('every_s', '-')} s, down "
             f"{d.get('down_s', '-')} s each (a scaled-down \"every few minutes\"; "
             "`goodput_model` below scales it).", "",
             f"1-minute load average when the benchmark started: "
             f"{u['loadavg_1m_at_start']:.2f}. A figure is published only if no run behind "
             "it had other processes' load above 2 (see `benchmarks/user_job_figures.py`).",
             "", "| figure | value | target |", "|---|---|---|"]
    if u.get("status", "ok") != "ok":
        lines[-2:-2] = [f"Parts that failed (their figures are missing): {u['status'][:600]}", ""]
    # recorded by hand beside a run's figures (figures of several runs, a run left out)
    for name, runs in u.get("medians", {}).items():
        kind = runs.get("kind", "full runs")  # e.g. "quick runs" (--quick, one mode)
        lines[-2:-2] = [f"{name}: the median of {len(runs['values'])} {kind} of the same "
                        f"setting, {_list3(runs['values'])} ({runs['why']}).", ""]
    for key in ("two_runs", "runs_merged", "rejoin_note", "diloco_drops_failed"):
        note = u.get(key)
        if note:
            lines[-2:-2] = [f"{key}: {note['why'] if isinstance(note, dict) else note}.", ""]
    lines += [f"| {WHAT[n]} ({statistic(u, n)}) | {value(u, n, full=True)} | {TARGETS[n]} |"
              for n in WHAT if n in u or n in u.get("invalid", {})]
    lines += ["", "| run | tokens/s | held-out loss | mean samples per step per group | "
              "useful tokens | drops | 1-min load start / end / max; others' runnable mean |",
              "|---|---|---|---|---|---|---|"]
    for tag, r in u["runs"].items():
        shares = ", ".join(f"g{g}: {v:.1f}" for g, v in (r.get("shares") or {}).items())
        lines.append(f"| `{tag}` | {_f(r.get('tokens_per_s'), '.0f')} | "
                     f"{_f(r.get('eval_loss'))} | {shares or '-'} | "
                     f"{_f(r.get('useful_tokens'), ',')} | {len(r.get('drops', []))} | "
                     f"{_load(r)} |")
    lines += ["", "tokens/s: every run over its own committed steps after the warm-up. "
              "The boxes alone ran one after another, each under its quota (so none "
              "borrowed the idle boxes' share) and at the batch it trained in the whole job "
              "(`segment_samples`), stopped once it counted `alone_counted` steps (settings)."]
    runs = u["runs"]
    for tag, g in runs.items():
        if not tag.endswith("groups-drops"):
            continue
        lines += ["", f"`{tag}`, laptop dropped (replica groups): group {g['killed_group']} (the "
                  f"laptop's); rejoins after each drop {_list(g['rejoins_s'])} s; samples "
                  f"used twice {g['samples_twice']}, skipped {g['samples_skipped']}; "
                  f"goodput {_f(g.get('goodput_tokens_per_h'), ',.0f')} useful tokens/h"
                  + (f"; the survivors' pause read from their {g['survivor_gap_read_from']}"
                     if g.get("survivor_gap_read_from") else "")
                  + (f"; the laptop's Ray started twice after {len(woke)} drop(s) (its "
                     "raylet exited at once)" if (woke := [e for e in g.get("drops", [])
                                                            if e.get("wake_attempts", 1) > 1])
                     else "") + "."]
    for tag, m in runs.items():
        if not tag.endswith("mesh-drops"):
            continue
        lines += ["", f"`{tag}`, one mesh, the same drops: attempts (start step, highest step) "
                  f"{m['attempts']}, {m['wasted_steps']} steps redone, kill -> first step "
                  f"of the next attempt {_list(m['resumes_s'])} s, "
                  + ("cut before it finished" if m["cut"] else "finished")
                  + f"; goodput {_f(m.get('goodput_tokens_per_h'), ',.0f')} useful tokens/h."]
    for key, line in (("goodput_window", _window_line), ("goodput_window_diloco", _window_line),
                      ("goodput_model", _model_line), ("goodput_model_diloco", _model_line)):
        if u.get(key):
            lines += ["", line(key, u[key], runs)]
    return "\n".join(lines) + "\n"


def _window_line(key: str, w: dict, runs: dict) -> str:
    return (f"`{key}`: both shapes over the same {w['window_s']:.1f} s from their first step "
            f"(drops in it: groups {w['drops_in_window'][0]}, one mesh "
            f"{w['drops_in_window'][1]}): {w['groups_tokens_per_h']:,.0f} against "
            f"{w['mesh_tokens_per_h']:,.0f} useful tokens/h; from the launch to the first "
            "step (`startup_s`): " + ", ".join(f"{_f(r.get('startup_s'), '.1f')} s (`{t}`)"
                                              for t, r in runs.items() if "startup_s" in r)
            + ".")


def _model_line(key: str, gm: dict, runs: dict) -> str:
    return (f"`{key}` (a model from the measured parts, not a measurement): loss per drop "
            f"{gm['loss_per_drop_groups_s']:.1f} s of the groups' rate "
            f"({gm['tokens_per_s_groups']:.0f} tokens/s) against "
            f"{gm['loss_per_drop_mesh_s']:.1f} s of the one mesh's "
            f"({gm['tokens_per_s_mesh']:.0f} tokens/s); goodput ratio "
            + ", ".join(f"{k.replace('_', ' ')}: {v:.2f}" for k, v in gm["ratio"].items()))


def write_section(path: str | Path, u: dict) -> None:
    """Replace this section of RESULTS.md (from its heading to the next ``## ``), or add it
    at the end of the file (the hand-written part, which ``run.py --results-md`` keeps)."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    section = markdown(u)
    if HEADING in text:
        a = text.index(HEADING)
        b = text.find("\n## ", a + len(HEADING))
        text = text[:a] + section + ("\n" + text[b + 1:] if b >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def summary(u: dict) -> str:
    return "\n".join(f"{f}: {v}" + (f"  (target {t})" if t else "")
                     for _, f, v, t in rows(u))
