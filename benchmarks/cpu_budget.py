"""Where the machine's CPU goes during the user's whole job: every process's CPU time, by
box of the virtual cluster (its network namespace) and process title, per counted step.

    python -m benchmarks.cpu_budget [--out FILE] [--key KEY] -- python -m benchmarks.user_job ...

Runs the command (a ``benchmarks.user_job`` run) while a sampler reads every process's
``utime + stime`` from ``/proc`` every :data:`PERIOD_S`, with the network namespace it is in
(``rmn...n0`` is the desktop, ``n1`` the tower, ``n2`` the laptop: ``harness.lab_job.BOXES``;
``host`` is everything outside the cluster: the benchmark's own driver and sampler, the
kernel's threads). Then, for each run of the benchmark (each ``*.steps`` folder of its work
folder), the window its tokens/s counts (group 0's committed steps after the first
``warmup``) gives each box's cores and each (box, title)'s core-seconds per step.

Why: ``user_job``'s ``box_cores`` reads the boxes' and the tailnet's cgroups only; the
head's Ray Train control actors run outside any quota (``Lab.free_head_services``), and on
a 2-core machine what they and the tunnel take is what the boxes cannot have. Only the
processes alive at a window's last sample are counted (from the window's first sample,
or from their start): one that ended inside the window is left out, so the figures are
lower bounds where processes come and go (a run's steady steps start none).
Written to ``results.json["user_job"][KEY]``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results.json"
PERIOD_S = 0.5
TICK = os.sysconf("SC_CLK_TCK")
BOXES = ("desktop", "tower", "laptop")  # harness.lab_job.BOXES: nodes 0, 1, 2


def box_of(netns: str) -> str:
    """The box a network namespace name stands for (``...n1`` -> ``tower``), else as is."""
    for i, box in enumerate(BOXES):
        if netns.startswith("rmn") and netns.endswith(f"n{i}"):
            return box
    return netns


def _namespaces() -> dict[int, str]:
    """Network namespace inode -> its name (``ip netns``'s)."""
    try:
        entries = list(os.scandir("/run/netns"))
    except OSError:
        return {}
    out = {}
    for e in entries:
        try:
            out[os.stat(e.path).st_ino] = e.name
        except OSError:
            continue
    return out


def snapshot() -> dict[str, tuple[str, str, float]]:
    """pid -> (title, box, CPU seconds so far) of every process now."""
    names, out = _namespaces(), {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            ino = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            continue
        title = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[pid] = (title, box_of(names.get(ino, "host")),
                    (int(fields[11]) + int(fields[12])) / TICK)
    return out


class Sampler:
    """:func:`snapshot` every :data:`PERIOD_S` on a thread, kept with its time."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.rows: list[dict[str, tuple[str, str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(PERIOD_S):
            row = snapshot()
            self.times.append(time.time())
            self.rows.append(row)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def used(self, t0: float, t1: float) -> tuple[float, Counter]:
        """(seconds between the samples nearest inside [t0, t1], core-seconds per (box,
        title) between them)."""
        i = bisect.bisect_left(self.times, t0)
        j = bisect.bisect_right(self.times, t1) - 1
        if j <= i:
            raise ValueError(f"no two samples between {t0:.1f} and {t1:.1f}")
        a, b = self.rows[i], self.rows[j]
        used: Counter = Counter()
        for pid, (title, box, cpu) in b.items():
            before = a.get(pid)
            used[(box, title)] += cpu - (before[2] if before and before[0] == title else 0.0)
        return self.times[j] - self.times[i], used


def step_times(steps_dir: Path) -> list[float]:
    """Group 0's committed steps' times, in step order (its start-up rows have no ``t``)."""
    from harness.replica_check import read

    rows = read(steps_dir).get(0, [])
    return [r["t"] for r in sorted((r for r in rows if "t" in r and "step" in r),
                                   key=lambda r: r["step"])]


def kind_of(box: str, title: str, head: str = BOXES[0]) -> str:
    """What a process is for: the training (Ray Train's workers), the tunnel (wireguard-go),
    the head's Ray processes (every other one on the head: Ray Train's per-group control
    actors, the groups' coordinator, the GCS, the dashboard, the driver), the other boxes'
    Ray processes (raylets, agents), or the host (outside the cluster)."""
    if title.startswith("ray::RayTrainWo"):
        return "training_workers"
    if title == "wireguard-go":
        return "tunnel_wireguard_go"
    if box == head:
        return "head_ray_processes"
    return "other_boxes_ray_processes" if box in BOXES else "host"


def by_kind(core_s_per_step: dict[str, float], s_per_step: float) -> dict[str, dict]:
    """:func:`kind_of`'s kinds: core-seconds per step and cores, from a run's
    ``core_s_per_step`` (keys ``"BOX TITLE"``)."""
    sums: Counter = Counter()
    for key, v in core_s_per_step.items():
        box, title = key.split(" ", 1)
        sums[kind_of(box, title)] += v
    return {k: {"core_s_per_step": round(v, 3), "cores": round(v / s_per_step, 3)}
            for k, v in sums.most_common()}


def budget(sampler: Sampler, steps_dir: Path, warmup: int) -> dict[str, Any] | None:
    """One run's cores per box and core-seconds per step per (box, title) over its counted
    steps; None when it counted fewer than two."""
    ts = step_times(steps_dir)[warmup:]
    if len(ts) < 2:
        return None
    secs, used = sampler.used(ts[0], ts[-1])
    steps = len(ts) - 1
    per_box: Counter = Counter()
    for (box, _), v in used.items():
        per_box[box] += v
    per_step = {f"{box} {title}": round(v / steps, 3)
                for (box, title), v in used.most_common() if v / steps >= 0.01}
    return {"steps": steps, "s_per_step": round(secs / steps, 3),
            "cores": {box: round(v / secs, 3) for box, v in per_box.most_common()},
            "cores_total": round(sum(per_box.values()) / secs, 3),
            "core_s_per_step": per_step, "by_kind": by_kind(per_step, secs / steps)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m benchmarks.cpu_budget [--out FILE] [--key KEY] "
              "[--warmup N] -- COMMAND ...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--key", default="cpu_budget")
    p.add_argument("--warmup", type=int, default=3, help="steps not counted (the "
                   "benchmark's warmup: 3 with --quick)")
    p.add_argument("--work", help="the benchmark's work folder (default: each "
                   "rmbench_user_job_* folder of the temporary directory made during the run)")
    args, command = p.parse_args(argv[:cut]), argv[cut + 1:]
    started, load0 = time.time(), os.getloadavg()[0]
    with Sampler() as sampler:
        rc = subprocess.call(command, cwd=REPO)
    works = [Path(args.work)] if args.work else [
        w for w in Path(tempfile.gettempdir()).glob("rmbench_user_job_*")
        if w.stat().st_mtime >= started]
    runs: dict[str, Any] = {}
    for work in works:
        for steps_dir in sorted(work.glob("*.steps")):
            got = budget(sampler, steps_dir, args.warmup)
            if got is not None:
                runs[steps_dir.name.removesuffix(".steps")] = got
    result = {"command": " ".join(command), "rc": rc, "loadavg_1m_at_start": load0,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
              "period_s": PERIOD_S, "runs": runs,
              "statistic": "one run each; CPU seconds from /proc over the counted steps"}
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("user_job", {})[args.key] = result
    path.write_text(json.dumps(data, indent=1))
    for name, r in runs.items():
        print(f"{name}: {r['s_per_step']} s/step, cores {r['cores']} "
              f"(total {r['cores_total']})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
