"""Turn the per-rank snapshots of a hang into one message a person can act on (pure logic).

:mod:`ray_mesh.observability.hang` collects, from every rank that still answers, a
snapshot (a JSON dict): how many collectives it has issued on each mesh dim's process group
(torch's per-group sequence number), the groups' member ranks, the collective it is blocked
in if a ray_mesh helper issued it, and its Python stacks. This module compares them: on a
dim, a rank whose count is below its peers' has not arrived at the collective they wait in.
Kept apart from the watchdog so the reasoning can be tested without processes.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import Any

from ray_mesh.core.safe import safe_text

STACK_FRAMES = 12  # innermost frames shown per thread
# Pipeline stages send and receive different numbers of point-to-point ops, so counts on the
# pp dim differ by design; it is judged only by collectives marked with hang.watched().
P2P_DIM = "pp"


@dataclass(frozen=True)
class Stall:
    """One collective some ranks wait in and others have not reached."""

    dim: str
    seq: int
    op: str
    group: tuple[int, ...]
    waiting: tuple[int, ...]
    missing: dict[int, int | None]  # rank -> its count on this dim (None: no answer)
    waited_s: float


def _frames_outside_libs(frames: list[dict[str, Any]]) -> bool:
    stdlib = sysconfig.get_paths()["stdlib"]
    return any("site-packages" not in f["file"] and not f["file"].startswith(stdlib)
               for f in frames)


def relevant_threads(threads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The threads worth showing: in torch.distributed or in code outside installed libraries
    (the train function); all threads when none qualifies."""
    keep = [t for t in threads if any(f"torch{os.sep}distributed" in f["file"]
                                      for f in t["frames"]) or _frames_outside_libs(t["frames"])]
    return keep or threads


def guess_op(frames: list[dict[str, Any]]) -> str | None:
    """The torch.distributed call a thread is blocked in (outermost public c10d frame)."""
    for f in frames:  # outermost first
        if f["file"].endswith("distributed_c10d.py") and not f["func"].startswith("_") \
                and f["func"] != "wrapper":
            return f["func"]
    return None


def op_of(snap: dict[str, Any], dim: str) -> str:
    pending = snap.get("pending")
    if pending and pending.get("dim") == dim:
        return pending["op"]
    for t in snap.get("threads", []):
        op = guess_op(t["frames"])
        if op:
            return op
    return "collective"


def _pending_on(snaps: dict[int, dict[str, Any]], group: tuple[int, ...], dim: str) -> bool:
    return any((snaps.get(r, {}).get("pending") or {}).get("dim") == dim for r in group)


def find_stalls(snaps: dict[int, dict[str, Any]], beats: dict[int, dict[str, Any]]
                ) -> list[Stall]:
    """Every (dim, group) where some ranks issued more collectives than others, oldest first.

    ``snaps``: rank -> snapshot of the ranks that answered; ``beats``: rank -> last heartbeat
    (``seq`` only) for every rank that ever published one, the fallback for silent ranks.
    """
    def seq_of(rank: int, dim: str) -> int | None:
        src = snaps.get(rank) or beats.get(rank)
        return None if src is None else src.get("seq", {}).get(dim)

    stalls: dict[tuple[str, tuple[int, ...]], Stall] = {}
    for snap in snaps.values():
        for dim, members in snap.get("groups", {}).items():
            group = tuple(members)
            if (dim, group) in stalls or (P2P_DIM in dim.split("=") and not _pending_on(
                    snaps, group, dim)):
                continue
            counts = {r: seq_of(r, dim) for r in group}
            known = [c for c in counts.values() if c is not None]
            if not known:
                continue
            top = max(known)
            missing = {r: c for r, c in counts.items() if c is None or c < top}
            if not missing:
                continue
            waiting = tuple(r for r, c in counts.items() if c == top)
            first = snaps.get(waiting[0], {})
            waited = max((snaps.get(r, {}).get("stalled_s", {}).get(dim, 0.0) for r in waiting),
                         default=0.0)
            stalls[(dim, group)] = Stall(dim, top, op_of(first, dim), group, waiting, missing,
                                         waited)
    waiting_anywhere = {r for s in stalls.values() for r in s.waiting}

    def is_cause(s: Stall) -> bool:  # a missing rank that waits nowhere else
        return any(r not in waiting_anywhere for r in s.missing)

    return sorted(stalls.values(), key=lambda s: (not is_cause(s), -s.waited_s))


def dim_name(label: str) -> str:
    """'dp_shard=dp' -> "'dp_shard' (same group as dp)": twins share one process group."""
    first, *same = label.split("=")
    return f"{first!r}" + (f" (same group as {', '.join(same)})" if same else "")


def _ranks(ranks: Any) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _state_line(rank: int, snap: dict[str, Any] | None, stalls: list[Stall],
                malformed: dict[int, str] | None = None) -> str:
    if snap is None and malformed and rank in malformed:
        return (f"rank {rank}: MALFORMED snapshot in the rendezvous store ({malformed[rank]}); "
                f"ignored: a client other than this job's ranks wrote it")
    if snap is None:
        return (f"rank {rank}: NO ANSWER (its process died, or its Python interpreter is "
                f"blocked holding the GIL)")
    where = f"{snap.get('host', '?')} pid {snap.get('pid', '?')}"
    waits = [s for s in stalls if rank in s.waiting]
    if waits:
        s = waits[0]
        return (f"rank {rank} ({where}): waiting in {s.op} #{s.seq} on dim "
                f"{dim_name(s.dim)} for {s.waited_s:.0f} s")
    behind = [s for s in stalls if rank in s.missing]
    if behind:
        what = "; ".join(f"{s.op} #{s.seq} on dim {dim_name(s.dim)} (its count there: "
                         f"{s.missing[rank]})" for s in behind)
        return (f"rank {rank} ({where}): NOT in any collective the others wait in; has not "
                f"arrived at {what}. See its stack below")
    return f"rank {rank} ({where}): not involved"


def format_stack(thread: dict[str, Any]) -> str:
    frames = thread["frames"][-STACK_FRAMES:]
    lines = [f"  thread {thread['name']!r}:"]
    for f in frames:
        lines.append(f"    File \"{f['file']}\", line {f['line']}, in {f['func']}")
        if f.get("code"):
            lines.append(f"      {f['code']}")
    return "\n".join(lines)


def summary(stalls: list[Stall]) -> str:
    """One line: the first stall, what waits and who did not arrive."""
    if not stalls:
        return "Hang summary: no rank is behind; the ranks are stuck inside one collective."
    s = stalls[0]
    return (f"Hang summary: {s.op} #{s.seq} on mesh dim {dim_name(s.dim)}: "
            f"{_ranks(s.waiting)} waiting, {_ranks(s.missing)} did not arrive "
            f"({len(stalls)} stalled collective(s) in all; full report above).")


FIELD_LIMIT = 1000  # characters kept of one string a rank sent (a code line, a file name)


def escaped(value: Any) -> Any:
    """``value`` with every string in it (keys included) escaped and cut
    (:func:`~ray_mesh.core.safe.safe_text`): a snapshot's thread names, files, code
    lines and host come from the ranks' processes, and are printed on the driver."""
    if isinstance(value, str):
        return safe_text(value, FIELD_LIMIT)
    if isinstance(value, dict):
        return {escaped(k): escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [escaped(v) for v in value]
    return value


def format_report(snaps: dict[int, dict[str, Any]], beats: dict[int, dict[str, Any]],
                  world_size: int, timeout_s: float, end_s: float,
                  malformed: dict[int, str] | None = None) -> str:
    """The message printed on the driver and carried by the run's error (every string a
    rank sent escaped).

    ``malformed``: rank -> why the value under its snapshot key was refused
    (:mod:`ray_mesh.observability.hang_store`); such a rank is listed as malformed.
    """
    snaps, beats = escaped(snaps), escaped(beats)
    malformed = escaped(malformed or {})
    stalls = find_stalls(snaps, beats)
    out = [f"ray_mesh: collective hang: a collective did not complete within "
           f"hang_timeout_s={timeout_s:g} s."]
    if stalls:
        out.append("Collectives some ranks wait in and others did not reach (first those "
                   "whose missing ranks wait nowhere, longest wait first):")
        waiting_anywhere = {r for s in stalls for r in s.waiting}
        for s in stalls:
            knock_on = [r for r in s.missing if r in waiting_anywhere]
            note = (f" (a knock-on: {_ranks(knock_on)} itself waits in another collective "
                    f"listed here)"
                    if knock_on and len(knock_on) == len(s.missing) else "")
            missing = ", ".join(f"{r} (at #{c})" if c is not None else f"{r} (no answer)"
                                for r, c in s.missing.items())
            out.append(f"  {s.op} #{s.seq} on mesh dim {dim_name(s.dim)} (group ranks "
                       f"{list(s.group)}): waiting {_ranks(s.waiting)} for "
                       f"{s.waited_s:.0f} s; did not arrive: rank {missing}{note}")
    else:
        out.append("Every rank that answered has issued the same collectives on every dim: "
                   "the ranks are inside one collective that does not finish (a network or "
                   "backend problem; try `ray-mesh doctor`).")
    out.append("Rank states:")
    out += ["  " + _state_line(r, snaps.get(r), stalls, malformed) for r in range(world_size)]
    out.append(
        f"The waiting ranks fail when the process-group timeout ({end_s:g} s) passes. A rank "
        f"that did not arrive usually skipped a collective (a branch on the rank, an early "
        f"return or exception) or is stuck in its own code, as its stack shows. If the "
        f"collective is just slow (huge checkpoints, a slow link), raise "
        f"MeshConfig(hang_timeout_s=...) / network.hang_timeout_s, or set it to None.")
    out.append("Python stacks:")
    for r in sorted(snaps):
        out.append(f"--- rank {r}")
        out += [format_stack(t) for t in relevant_threads(snaps[r].get("threads", []))]
    # Last, so that an error display that keeps only the head and tail (Ray Train's) shows it.
    out.append(summary(stalls))
    return safe_text("\n".join(out), multiline=True)
