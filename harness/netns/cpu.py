"""A CPU quota per namespace node: a slower box on the same machine (cgroup v1 ``cpu``).

``ray start`` of that node runs inside a cgroup whose CFS quota is ``cores`` CPUs' worth of
time per period; every process it starts (raylet, workers, their threads) inherits it. Unlike
a niceness or a competing process, the quota holds however busy the rest of the machine is:
the node does at most ``cores`` of work per second, alone or not. And at least as much while
it has work: a slower box is another machine, whose CPU the rest of this one does not take.
At the default weight (cgroup v1 ``cpu.shares`` 1024) the whole cgroup weighed as much as any
one process beside it, so two CPU-bound processes and a busy cluster (load 48) left the box a
few hundredths of a core: its workers did not start in three minutes. It gets the largest
weight (:data:`SHARES`); the quota still caps it. A box without a quota can have a cgroup
with no cap (``cores=None``) at :data:`FREE_SHARES`: two CPU hogs beside it take a small part
of its CPU, and the suite's niced processes still get some.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
# A 10 ms period, not the kernel's default 100 ms: under a quota the node runs in bursts of
# quota x period and then waits for the next period, so at 100 ms a box at 0.2 cores stalls
# up to 80 ms at a time (measured: its step times came in multiples of 0.1 s), and every
# exchange with it waits for its next burst. A slower real box is slow evenly; 10 ms is
# closer to that.
PERIOD_US = 10_000
SHARES = 262_144  # cgroup v1's largest cpu.shares (the default is 1024)
FREE_SHARES = 4_096  # a box without a quota
IDLE_SHARES = 2  # cgroup v1's smallest: runs on what every other process leaves idle
DEFAULT_SHARES = 1024  # cgroup v1's default: the weight of a process in no cgroup of its own


def cpu_quota_unavailable_reason() -> str | None:
    """Why quotas cannot be set here (None when they can)."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT}"
    return None


def make_cgroup(name: str, cores: float | None, shares: int | None = None) -> Path:
    """A cgroup ``name`` limited to ``cores`` CPUs (e.g. 0.3) per :data:`PERIOD_US`; with
    ``cores=None`` not limited, only weighted (a box of its own, at full speed). ``shares``:
    another weight than the box's (:data:`IDLE_SHARES`: what only idle CPU may run)."""
    if cores is not None and not 0.01 <= cores <= 256:
        raise ValueError(f"cores={cores}: give a CPU quota between 0.01 and 256")
    path = CPU_ROOT / name
    path.mkdir(exist_ok=True)
    (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (path / "cpu.cfs_quota_us").write_text(str(-1 if cores is None
                                               else int(cores * PERIOD_US)))
    # Capped, it may weigh the most; uncapped, four processes' worth: enough that two CPU
    # hogs beside it take a small part, not so much that the suite's niced unit tests
    # (weight 110) get no CPU while the box runs (a 30 s bound there failed once).
    weight = shares if shares is not None else SHARES if cores is not None else FREE_SHARES
    set_shares(path, weight)
    return path


def set_shares(path: Path, shares: int = DEFAULT_SHARES) -> None:
    """Weigh the cgroup at ``path`` anew (default: the kernel's default weight, as any
    process outside a cgroup of its own): e.g. work that ran on idle CPU only while a job
    ran, and must now get its fair share beside whatever else runs (a CPU hog starves a
    cgroup at :data:`IDLE_SHARES` for good)."""
    (path / "cpu.shares").write_text(str(shares))


def in_cgroup(path: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run inside the cgroup at ``path`` (it and every process it starts)."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(path), *cmd]


def remove_cgroup(path: Path) -> None:
    """Remove the cgroup (once its processes are gone; a leftover is harmless)."""
    with contextlib.suppress(OSError):
        path.rmdir()


__all__ = ["CPU_ROOT", "DEFAULT_SHARES", "IDLE_SHARES", "cpu_quota_unavailable_reason",
           "in_cgroup", "make_cgroup", "set_shares",
           "remove_cgroup"]
