"""Reading a replica-group run's logs (``harness/replica_train.py``'s ``log_dir``): which
samples were used, the survivors' step gaps around a kill, when the killed group trained
again. Shared by the tests and ``benchmarks/replica_groups.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _files(log_dir: str | Path, suffix: str) -> dict[int, Path]:
    """Group id -> its ``g<id><suffix>`` file: ``.jsonl`` (committed steps) is not
    ``.held.jsonl`` (held samples), which a ``g*.jsonl`` glob also matches."""
    out = {}
    for f in sorted(Path(log_dir).glob(f"g*{suffix}")):
        if (gid := f.name[1:-len(suffix)]).isdigit():
            out[int(gid)] = f
    return out


def _per_group(log_dir: str | Path, suffix: str) -> dict[int, list[dict[str, Any]]]:
    return {gid: [json.loads(line) for line in f.read_text().splitlines() if line]
            for gid, f in _files(log_dir, suffix).items()}


def top_step(log_dir: str | Path) -> int:
    """The highest step any group committed so far (``g<i>.jsonl``), while the run writes
    them."""
    top = 0
    for f in _files(log_dir, ".jsonl").values():
        for line in f.read_text().splitlines():
            try:
                top = max(top, json.loads(line)["step"])
            except (ValueError, KeyError):
                continue  # a line being written
    return top


def read(log_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Per group, its committed steps in the order they were logged."""
    return _per_group(log_dir, ".jsonl")


def read_inner(log_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Per group, its optimizer steps (``g<i>.inner.jsonl``: one row per step its rank 0
    took, ``harness/lab_train.py``): under DiLoCo the inner steps between two commits, so
    a survivor's pause is read per step, not per round of ``every`` steps."""
    return _per_group(log_dir, ".inner.jsonl")


def write_held(log_dir: str | Path, gid: int, step: int, ranges: list, attempt: str) -> None:
    """Before a group's commit of ``step``: the samples it holds (``g<i>.held.jsonl``). A
    group killed after the average took its contribution but before it logged the step
    leaves only this line; :func:`read_used` credits it from the survivors' rows."""
    with (Path(log_dir) / f"g{gid}.held.jsonl").open("a") as f:
        f.write(json.dumps({"step": step, "ranges": ranges, "attempt": attempt}) + "\n")


def read_used(log_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """:func:`read`, plus the held samples (:func:`write_held`) of each group that the
    survivors' commit of a step counted among its contributors (their rows'
    ``contributors``) but that logged no committed row of that step: it died between the
    average and its own log line, its samples trained the model. Credited rows carry
    ``"credited": True``; a step whose missing contributors cannot be told apart (more
    candidate groups than missing ones) credits none, so nothing is hidden."""
    logs = read(log_dir)
    held = _per_group(log_dir, ".held.jsonl")
    by_step: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for gid, rows in logs.items():
        for row in rows:
            by_step.setdefault(row["step"], []).append((gid, row))
    out = {gid: list(rows) for gid, rows in logs.items()}
    for step, rows in by_step.items():
        logged = {gid for gid, _ in rows}
        counted = max(row.get("contributors", 0) for _, row in rows)
        candidates = [(gid, h) for gid, hs in held.items() if gid not in logged
                      for h in hs if h["step"] == step]
        if 0 < counted - len(logged) == len(candidates):
            for gid, h in candidates:
                out.setdefault(gid, []).append({**h, "credited": True})
    return out


def finals(log_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """Per group, the final line of each attempt that finished."""
    return _per_group(log_dir, ".final.json")


def sample_use(logs: dict[int, list[dict[str, Any]]]) -> tuple[list[int], list[int]]:
    """(samples used twice or more, samples skipped below the highest one used)."""
    seen: dict[int, int] = {}
    for rows in logs.values():
        for row in rows:
            for start, n in row["ranges"]:
                for i in range(start, start + n):
                    seen[i] = seen.get(i, 0) + 1
    twice = sorted(i for i, c in seen.items() if c > 1)
    top = max(seen, default=-1)
    skipped = [i for i in range(top + 1) if i not in seen]
    return twice, skipped


def kill_time(marker_prefix: str | Path, gid: int) -> float:
    return float(Path(f"{marker_prefix}.g{gid}").read_text())


def _survivor_pairs(logs: dict[int, list[dict[str, Any]]], killed: int, key: str):
    """(earlier, later) values of ``key`` in each survivor's consecutive committed steps."""
    for gid, rows in logs.items():
        if gid != killed:
            values = [r[key] for r in rows]
            yield from zip(values, values[1:], strict=False)


def survivor_gaps(logs: dict[int, list[dict[str, Any]]], killed: int, t_kill: float,
                  window_s: float = 60.0) -> float:
    """The survivors' longest wait between two committed steps that spans or follows the
    kill (within ``window_s``)."""
    return max((b - a for a, b in _survivor_pairs(logs, killed, "t")
                if b >= t_kill and a <= t_kill + window_s), default=0.0)


def steps_lost(logs: dict[int, list[dict[str, Any]]], killed: int) -> int:
    """Committed steps the survivors took again (a step number logged twice or going back)."""
    return sum(a - b + 1 for a, b in _survivor_pairs(logs, killed, "step") if b <= a)


def rejoin_s(logs: dict[int, list[dict[str, Any]]], killed: int, t_kill: float) -> float | None:
    """From the kill to the killed group's first committed step of a later attempt."""
    after = [r["t"] for r in logs.get(killed, []) if r["t"] > t_kill]
    return min(after) - t_kill if after else None
