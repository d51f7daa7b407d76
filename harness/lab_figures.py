"""The figures of one run of the lab job (``harness/lab_job.py``), from its step log
(``harness/lab_train.py``) and its console: what ``tests/netns/test_lab_job.py`` checks and
a benchmark records.

Times are ``time.time()`` of the processes that wrote them (one clock: every namespace node
is this machine), the kill's included.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from harness import replica_check as rc

GROUPS_LINE = re.compile(r"ray-mesh: replica groups: (.*)")
GROUP_ON = re.compile(r"group (\d+): ([^\s;]+) on ([^\s;]+)")
EVENT = re.compile(r"ray-mesh: replica group (\d+) (\w+) at step (\d+): (.*)")
THROUGHPUT = re.compile(r"throughput:\s+([0-9.e+]+) samples/s, ([0-9.e+]+) tokens/s")


def console_groups(console: str) -> dict[int, tuple[str, str]]:
    """Per group, (layout, node address) from the run's first console line about them."""
    m = GROUPS_LINE.search(console)
    return {int(g): (layout, node) for g, layout, node in GROUP_ON.findall(m[1] if m else "")}


def console_events(console: str) -> list[tuple[int, str, int]]:
    """(group, kind, step) of each membership event line, in order."""
    return [(int(g), kind, int(step)) for g, kind, step, _ in EVENT.findall(console)]


def mean_share(logs: dict[int, list[dict]], after_step: int) -> dict[int, float]:
    """Per group: its mean samples per committed step after ``after_step``."""
    out = {}
    for gid, rows in logs.items():
        late = [sum(n for _, n in r["ranges"]) for r in rows if r["step"] > after_step]
        out[gid] = sum(late) / max(1, len(late))
    return out


def totals_by_step(logs: dict[int, list[dict]]) -> dict[int, tuple[int, int]]:
    """Per step: (samples of the groups' contributions, how many groups contributed)."""
    totals: dict[int, tuple[int, int]] = {}
    for rows in logs.values():
        for r in rows:
            n, k = totals.get(r["step"], (0, 0))
            totals[r["step"]] = (n + sum(c for _, c in r["ranges"]), k + 1)
    return totals


def figures(steps_dir: Path, console: str, *, killed: int | None = None,
            t_kill: float | None = None, reference_loss: float | None = None) -> dict[str, Any]:
    """The run's figures (``killed``/``t_kill``: the group on the box that was killed and
    when; None for a run without a failure)."""
    logs, finals = rc.read(steps_dir), rc.finals(steps_dir)
    twice, skipped = rc.sample_use(rc.read_used(steps_dir))
    last = {g: rows[-1] for g, rows in finals.items() if rows}
    losses = {g: r["eval_loss"] for g, r in last.items()}
    out: dict[str, Any] = {
        "final_step": {g: r["step"] for g, r in last.items()},
        "final_eval_loss": losses,
        "samples_twice": len(twice), "samples_skipped": len(skipped),
        "samples_used": sum(n for rows in logs.values() for r in rows for _, n in r["ranges"]),
        "groups": console_groups(console),
        "events": console_events(console),
    }
    if m := THROUGHPUT.search(console):
        out.update(samples_per_s=float(m[1]), tokens_per_s=float(m[2]))
    evaluated = [v for v in losses.values() if v is not None]  # None: ended before an eval
    if reference_loss is not None and evaluated:
        mean = sum(evaluated) / len(evaluated)
        out.update(reference_eval_loss=reference_loss,
                   final_loss_rel_diff=abs(mean - reference_loss) / reference_loss)
    if killed is not None and t_kill is not None:
        rows = logs.get(killed, [])
        out.update(
            killed_group=killed,
            survivor_max_step_gap_s=rc.survivor_gaps(logs, killed, t_kill),
            survivor_steps_lost=rc.steps_lost(logs, killed),
            rejoin_s=rc.rejoin_s(logs, killed, t_kill),
            killed_group_attempts=len({r["attempt"] for r in rows}),
            steps_after_rejoin=len([r for r in rows if r["t"] > t_kill]),
            rejoin_bytes=last[killed]["rejoin_bytes"] if killed in last else None,
            heal_s=last[killed]["heal_s"] if killed in last else None,
            rejoin_phases=rejoin_phases(steps_dir, killed, t_kill))
    return out


def rejoin_phases(steps_dir: Path, killed: int, t_kill: float) -> dict[str, float] | None:
    """Where the killed group's rejoin went, from the kill: to its new attempt's worker
    process and train function, to its group made (model, data, registration) and to its
    first commit returned (joined the run, healed)."""
    path = Path(steps_dir) / f"g{killed}.phases.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    later = [r for r in rows if r["t_fn"] > t_kill]
    if not later:
        return None
    r = later[0]
    return {"to_worker_process_s": round(r.get("t_proc", r["t_fn"]) - t_kill, 1),
            "to_train_fn_s": round(r["t_fn"] - t_kill, 1),
            "group_made_s": round(r.get("t_group", r["t_fn"]) - t_kill, 1),
            "joined_s": round(r["t_joined"] - t_kill, 1)}


__all__ = ["console_events", "console_groups", "figures", "mean_share", "totals_by_step"]
