"""The user-job benchmark's accounting (``benchmarks/user_job.py``), Ray-free and pure but
for :class:`LoadSampler`: tokens/s from step logs, useful tokens under failures, and the
rule that keeps a figure taken on a busy machine out of the results.

**Useful tokens** are the tokens of the steps that count towards the final model:

* replica groups: every committed step's samples, each counted once (a group's
  contribution enters the step log only when the step committed with it in the average;
  a group killed mid-step contributes nothing to that step, and its samples are handed out
  again), times the tokens per sample;
* one mesh with checkpoint-restart: the steps of the final model's lineage, i.e. the
  highest step of the last attempt (every attempt resumes at its checkpoint's step, and
  the steps an attempt took past the checkpoint the next one resumed from are wasted),
  times the tokens per step (its rows come from each box's own disk by step, so a
  resumed attempt reads what an unbroken run would: no step is counted twice).

**Goodput** is useful tokens per hour of wall time in the **training window**: from
each shape's first committed step, over the same number of seconds for both (the shorter
of the two runs' spans from their first to their last step), so both windows hold the
same drops at the same offsets (the drops are timed from each run's first step). A run of
hours starts once: its bring-up (``ray-mesh run`` to the first step: 38 s for the one
mesh, 68-107 s for three groups' Ray Train controllers on this rig) is no part of its
tokens per hour, but in a run of two or three minutes it was a third to a half of the
time and pulled the ratio towards 1 (:func:`same_window`). The figure from the launch to
the last step is kept beside it (``goodput_vs_restart_from_launch``), with each shape's
``startup_s``.

**The load rule** (the project's: a figure taken at load above 2 on this 2-core machine is
not a figure): every run records ``os.getloadavg()`` at its start and end and its maximum,
and the mean runnable threads of processes that are *not* the benchmark's (sampled every
``period_s``): the benchmark's own virtual cluster runs five workers on two cores, so its
own load average is above 2 by design. A run whose others' load exceeded ``LOAD_LIMIT``,
or a benchmark that started on a machine whose 1-minute load was above it, is invalid:
its figures are recorded, and no figure or ratio with such a run on either side is
published (:func:`publish`).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

LOAD_LIMIT = 2.0


# ----------------------------------------------------------------------------- throughput
def step_samples(logs: dict[int, list[dict[str, Any]]]) -> dict[int, tuple[float, int]]:
    """Per committed step: (the latest commit time of any group, samples of all groups)."""
    out: dict[int, tuple[float, int]] = {}
    for rows in logs.values():
        for r in rows:
            t, n = out.get(r["step"], (0.0, 0))
            out[r["step"]] = (max(t, r["t"]), n + sum(c for _, c in r["ranges"]))
    return out


def tokens_per_s(logs: dict[int, list[dict[str, Any]]], tokens_per_sample: int,
                 warmup: int) -> tuple[float, int]:
    """(tokens per second, steps counted) over the committed steps after ``warmup``: the
    tokens of steps ``warmup + 2 ..`` over the time from step ``warmup + 1``'s commit to the
    last step's (bring-up and the first steps left out)."""
    per = step_samples(logs)
    steps = sorted(s for s in per if s > warmup)
    if len(steps) < 2:
        raise ValueError(f"only {len(steps)} committed steps after the first {warmup}")
    span = per[steps[-1]][0] - per[steps[0]][0]
    if span <= 0:
        raise ValueError("the counted steps took no time")
    return sum(per[s][1] for s in steps[1:]) * tokens_per_sample / span, len(steps) - 1


def steps_after_warmup(rows: list[dict[str, Any]], warmup: int) -> int:
    """How many steps :func:`tokens_per_s` would count in ``rows`` (a run's step rows, any
    group's): its committed steps after ``warmup`` less the first, from whose commit the
    time is taken."""
    return max(0, len({r["step"] for r in rows if r["step"] > warmup}) - 1)


def throughput_of_sum(whole_tokens_per_s: float,
                      alone_logs: dict[str, dict[int, list[dict[str, Any]]]],
                      tokens_per_sample: int, warmup: int
                      ) -> tuple[float, dict[str, dict[str, float]]]:
    """The whole job's tokens/s over the sum of each box alone's, and per alone run (its
    step log in ``alone_logs``) its ``tokens_per_s`` and ``steps_counted``: each over its
    own committed steps after ``warmup`` (the runs went one after another, each under its
    box's CPU quota; no time in common is needed)."""
    rates = {}
    for tag, logs in alone_logs.items():
        tps, n = tokens_per_s(logs, tokens_per_sample, warmup)
        rates[tag] = {"tokens_per_s": tps, "steps_counted": n}
    return whole_tokens_per_s / sum(r["tokens_per_s"] for r in rates.values()), rates


def mean_shares(logs: dict[int, list[dict[str, Any]]], warmup: int) -> dict[int, float]:
    """Per group, its mean samples per committed step after ``warmup``."""
    out = {}
    for gid, rows in logs.items():
        late = [sum(n for _, n in r["ranges"]) for r in rows if r["step"] > warmup]
        out[gid] = sum(late) / len(late) if late else 0.0
    return out


def alone_batch(mean_share: float, dp: int) -> int:
    """A box alone trains at its mean share in the whole job, rounded to its data-parallel
    size (which must divide a group's samples), at least one sample per rank."""
    return max(dp, round(mean_share / dp) * dp)


def alone_every(alone_segment: int, dp: int, every: int, whole_segment: int) -> int:
    """DiLoCo: the ``every`` that gives a box alone the inner steps it took in the whole job.

    An inner step there takes an equal share's batch, ``whole_segment / every`` over the
    group's ranks (``ray_mesh.replicas.shares.inner_steps``), and a group of a larger share
    takes more of them. Alone, with the whole job's ``every`` over its own share as
    ``segment_samples``, the same box took larger steps (the desktop 10 samples a step
    against 8, 2026-11-30) or smaller (the tower 6 against 8), and an inner step costs a
    fixed part plus its samples: the sum of the boxes alone was of other work than the
    whole job's. The ``every`` returned makes the steps of the same batch, so of the same
    count (the smallest that does)."""
    from ray_mesh.replicas.shares import inner_steps

    per_rank = -(-alone_segment // dp)
    want = inner_steps(list(range(per_rank)), per_rank, whole_segment, every, dp)
    for k in range(1, alone_segment + 1):
        got = inner_steps(list(range(per_rank)), per_rank, alone_segment, k, dp)
        if len(got[0]) <= len(want[0]):
            return k
    return alone_segment


# ----------------------------------------------------------------------------- failures
def killed_group(logs: dict[int, list[dict[str, Any]]], t_kill: float) -> int | None:
    """The group that lost its node: the one that started a new attempt after ``t_kill``,
    else the one with no committed step after it (it never came back)."""
    for gid, rows in logs.items():
        if len({r.get("attempt", 0) for r in rows}) > 1:
            return gid
    gone = [gid for gid, rows in logs.items() if not any(r["t"] > t_kill for r in rows)]
    return gone[0] if len(gone) == 1 else None


def groups_useful_tokens(logs: dict[int, list[dict[str, Any]]], tokens_per_sample: int) -> int:
    """Replica groups: the committed steps' samples, each once (see the module docstring)."""
    seen: set[int] = set()
    for rows in logs.values():
        for r in rows:
            for start, n in r["ranges"]:
                seen.update(range(start, start + n))
    return len(seen) * tokens_per_sample


def mesh_lineage(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One mesh's step log (``{"start": s, "t": ...}`` when an attempt began at step ``s``;
    ``{"step": n, "t": ...}`` after each step) read into its attempts and lineage:
    ``final_step`` (the last attempt's highest step), ``wasted_steps`` (steps taken past
    the checkpoint the next attempt resumed from), ``attempts`` [(start, highest step)]."""
    attempts: list[list[int]] = []
    for r in rows:
        if "start" in r:
            attempts.append([r["start"], r["start"]])
        elif attempts:
            attempts[-1][1] = max(attempts[-1][1], r["step"])
    wasted = sum(max(0, top - nxt[0]) for (_, top), nxt in zip(attempts, attempts[1:],
                                                               strict=False))
    return {"final_step": attempts[-1][1] if attempts else 0, "wasted_steps": wasted,
            "attempts": [tuple(a) for a in attempts]}


def goodput_per_hour(useful_tokens: float, t_launch: float, t_last: float) -> float:
    if t_last <= t_launch:
        raise ValueError("the run's last step is not after its launch")
    return useful_tokens * 3600.0 / (t_last - t_launch)


def same_window(logs: dict[int, list[dict[str, Any]]], tokens_per_sample: int,
                mesh_rows: list[dict[str, Any]], mesh_step_tokens: int,
                t_kills: tuple[list[float], list[float]]) -> dict[str, Any]:
    """Goodput of both shapes over one training window (module docstring): the groups'
    samples committed after their first step and the one mesh's lineage steps after its
    first step, each within ``window_s`` of that first step; ``t_kills``: (the groups'
    drops, the mesh's), counted per window, so a reader sees both windows held the same."""
    g_ts = sorted(r["t"] for rows in logs.values() for r in rows)
    m_ts = sorted(r["t"] for r in mesh_rows if "step" in r)
    if len(g_ts) < 2 or len(m_ts) < 2:
        raise ValueError("a shape took fewer than two steps: no training window to compare")
    window = min(g_ts[-1] - g_ts[0], m_ts[-1] - m_ts[0])
    g0, m0 = g_ts[0], m_ts[0]
    g_tokens = groups_useful_tokens({g: [r for r in rows if g0 < r["t"] <= g0 + window]
                                     for g, rows in logs.items()}, tokens_per_sample)
    steps = (mesh_lineage([r for r in mesh_rows if r["t"] <= m0 + window])["final_step"]
             - mesh_lineage([r for r in mesh_rows if r["t"] <= m0])["final_step"])
    g_h = g_tokens * 3600.0 / window
    m_h = max(0, steps) * mesh_step_tokens * 3600.0 / window
    return {"window_s": window, "groups_tokens_per_h": g_h, "mesh_tokens_per_h": m_h,
            "ratio": g_h / m_h if m_h > 0 else None,
            "drops_in_window": [sum(g0 < t <= g0 + window for t in t_kills[0]),
                                sum(m0 < t <= m0 + window for t in t_kills[1])],
            "first_step_t": [g0, m0]}


def drop_times(t0: float, first_s: float, every_s: float, until: float) -> list[float]:
    """When the box goes down: ``first_s`` after ``t0`` (the run's first committed step),
    then every ``every_s``, before ``until``."""
    out, t = [], t0 + first_s
    while t < until:
        out.append(t)
        t += every_s
    return out


# ----------------------------------------------------------------------------- the load rule
def run_invalid(load: dict[str, Any], limit: float = LOAD_LIMIT) -> str | None:
    """Why a run's figures are not figures (see the module docstring), or None."""
    others = load.get("others_runnable_mean")
    if others is not None and others > limit:
        return (f"other processes' load {others:.2f} > {limit:g} during the run "
                f"(1-min load average {load.get('loadavg_1m_max', float('nan')):.1f} at most)")
    return None


def publish(figures: dict[str, Any], sides: dict[str, list[str]], runs: dict[str, dict],
            start_load: float | None = None, limit: float = LOAD_LIMIT) -> dict[str, Any]:
    """``figures`` with each figure whose runs (``sides[name]``) ran at load above
    ``limit`` set to None; the value kept in ``recorded`` and the reason in ``invalid``."""
    out: dict[str, Any] = {**figures, "recorded": {}, "invalid": {}}
    for name, value in figures.items():
        why = []
        if start_load is not None and start_load > limit:
            why.append(f"the machine's 1-min load was {start_load:.1f} > {limit:g} when the "
                       "benchmark started")
        for run in sides.get(name, []):
            if run not in runs:
                why.append(f"{run}: not run")
            elif reason := run_invalid(runs[run].get("load", {}), limit):
                why.append(f"{run}: {reason}")
        if why:
            out[name] = None
            out["recorded"][name] = value
            out["invalid"][name] = "; ".join(why)
    return out


def _netns_inode(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def cgroup_cpu_s(path: Path) -> dict[int, float]:
    """CPU seconds (user + system, its ended threads included) of each process in the
    cgroup at ``path`` (``cgroup.procs``); {} when the cgroup is gone."""
    out: dict[int, float] = {}
    try:
        pids = [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def cores_used(series: list[tuple[float, dict[int, float]]], t0: float, t1: float
               ) -> float | None:
    """The cores a cgroup's processes used between ``t0`` and ``t1``: over each pair of
    consecutive samples inside that window, the CPU seconds gained by the processes in both
    samples, summed, over the time the pairs span (None: fewer than two samples there). A
    process that started or ended between two samples is left out of that pair, so the
    figure leans low by at most one sampling period of such a process."""
    inside = [(t, procs) for t, procs in series if t0 <= t <= t1]
    if len(inside) < 2:
        return None
    pairs = zip(inside, inside[1:], strict=False)
    used = sum(max(0.0, b[pid] - a[pid]) for (_, a), (_, b) in pairs for pid in b.keys() & a.keys())
    return used / (inside[-1][0] - inside[0][0])


class LoadSampler:
    """Samples the load while a run goes (a thread; see the module docstring): the 1-min
    load average and the runnable (R or D) threads of processes that are neither this
    process's descendants nor in one of ``namespaces`` (``/run/netns/<name>``); and, for
    each of ``cgroups`` (name -> cgroup folder: a box's, the tailnet's), its processes' CPU
    seconds (:meth:`box_cores`: what each box used over a window of the run, against its
    quota)."""

    def __init__(self, namespaces: list[str], period_s: float = 2.0,
                 cgroups: dict[str, Path] | None = None) -> None:
        self.cgroups = dict(cgroups or {})
        self.cpu: dict[str, list[tuple[float, dict[int, float]]]] = {n: [] for n in self.cgroups}
        self.inodes = {os.stat(f"/run/netns/{n}").st_ino for n in namespaces
                       if Path(f"/run/netns/{n}").exists()}
        self.period_s = period_s
        self.loads: list[float] = []
        self.others: list[int] = []
        self.who: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.start_load = os.getloadavg()[0]

    def _ours(self, pid: int, parents: dict[int, int]) -> bool:
        me, seen = os.getpid(), 0
        p = pid
        while p > 1 and seen < 64:
            if p == me:
                return True
            p, seen = parents.get(p, 0), seen + 1
        return _netns_inode(pid) in self.inodes

    def sample(self) -> int:
        """Runnable threads of others, now (their commands counted in ``who``)."""
        states: dict[int, int] = {}
        parents: dict[int, int] = {}
        names: dict[int, str] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid, runnable = int(name), 0
            try:
                with open(f"/proc/{pid}/stat") as f:
                    head, tail = f.read().rsplit(")", 1)
                parents[pid], names[pid] = int(tail.split()[1]), head.split("(", 1)[1]
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        runnable += f.read().rsplit(")", 1)[1][1] in "RD"
            except (OSError, IndexError, ValueError):
                continue
            if runnable:
                states[pid] = runnable
        others = {pid: n for pid, n in states.items() if not self._ours(pid, parents)}
        for pid, n in others.items():
            self.who[names[pid]] = self.who.get(names[pid], 0) + n
        return sum(others.values())

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.loads.append(os.getloadavg()[0])
            self.others.append(self.sample())
            for name, path in self.cgroups.items():
                self.cpu[name].append((time.time(), cgroup_cpu_s(path)))

    def box_cores(self, t0: float, t1: float) -> dict[str, float | None]:
        """Cores each cgroup's processes used between unix times ``t0`` and ``t1``."""
        return {name: cores_used(series, t0, t1) for name, series in self.cpu.items()}

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def summary(self) -> dict[str, Any]:
        end = os.getloadavg()[0]
        return {"loadavg_1m_start": self.start_load, "loadavg_1m_end": end,
                "loadavg_1m_max": max([self.start_load, end, *self.loads]),
                "others_runnable_mean": statistics.fmean(self.others) if self.others else None,
                "others_runnable_max": max(self.others, default=None),
                "samples": len(self.others), "period_s": self.period_s,
                "others_most_runnable": dict(sorted(self.who.items(), key=lambda x: -x[1])[:8])}


# ----------------------------------------------------------------------------- after a drop
def rejoin_after(logs: dict[int, list[dict[str, Any]]], killed: int | None,
                 t_kill: float) -> float | None:
    """From ``t_kill`` to the killed group's first committed step of another attempt than
    the one it was in at ``t_kill`` (attempts are ids, not ordered)."""
    rows = sorted(logs.get(killed, []) if killed is not None else [], key=lambda r: r["t"])
    before = [r.get("attempt") for r in rows if r["t"] <= t_kill]
    was = before[-1] if before else object()
    after = [r["t"] for r in rows if r["t"] > t_kill and r.get("attempt") != was]
    return min(after) - t_kill if after else None


def mesh_resumes(rows: list[dict[str, Any]], t_kills: list[float]) -> list[float | None]:
    """Per drop, from the kill to the one mesh's first step of an attempt begun after it."""
    out = []
    for t in t_kills:
        began = [r["t"] for r in rows if "start" in r and r["t"] > t]
        steps = [r["t"] for r in rows if "step" in r and began and r["t"] > min(began)]
        out.append(min(steps) - t if steps else None)
    return out


def mesh_step_s(rows: list[dict[str, Any]], skip: int = 3) -> float | None:
    """The one mesh's median seconds per step inside an attempt (its first ``skip``
    steps left out)."""
    gaps, since = [], None
    for a, b in zip(rows, rows[1:], strict=False):
        if "start" in b:
            since = 0
            continue
        since = 0 if since is None else since + 1
        if "step" in a and "step" in b and b["step"] == a["step"] + 1 and since >= skip:
            gaps.append(b["t"] - a["t"])
    return statistics.median(gaps) if gaps else None


def goodput_model(rate_groups: float, loss_groups_s: float, rate_mesh: float,
                  loss_mesh_s: float, intervals_s: tuple[float, ...] = (180.0, 300.0, 600.0)
                  ) -> dict[str, float]:
    """Goodput ratio if a node dropped every T seconds: each shape's failure-free tokens/s
    times (1 - its loss per drop / T), its loss per drop in seconds of its whole rate."""
    return {f"every_{t:g}s": rate_groups * max(0.0, 1 - loss_groups_s / t)
            / (rate_mesh * max(1e-9, 1 - loss_mesh_s / t)) for t in intervals_s}


def wait_quiet(max_s: float, say=print, limit: float = LOAD_LIMIT) -> float:
    """Wait (at most ``max_s``) for the 1-min load average to fall to ``limit``; it."""
    deadline = time.monotonic() + max_s
    load = os.getloadavg()[0]
    if load > limit:
        say(f"1-min load {load:.1f} > {limit:g}: waiting up to {max_s:.0f} s for a quiet machine")
    while load > limit and time.monotonic() < deadline:
        time.sleep(5)
        load = os.getloadavg()[0]
    return load
