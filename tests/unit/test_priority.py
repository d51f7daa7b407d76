"""ray_mesh.core.priority: every thread of a process gets the training niceness (Ray-free)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import ray_mesh

# Runs in a child process: it raises its own niceness to START (always allowed) the way Ray's
# core worker does, starts threads before and after, then asks ray_mesh for TARGET. With
# "drop", a root child first becomes nobody (setuid drops every capability, CAP_SYS_NICE too).
CHILD = textwrap.dedent("""
    import json, os, sys, threading
    if os.geteuid() == 0:  # from 0, whatever the runner's own niceness (the unit stream's 10),
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # before the import starts threads
    from ray_mesh.core import priority

    start, target, drop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "drop"
    if drop and os.geteuid() == 0:
        os.setgid(65534); os.setuid(65534)

    def every_thread():
        return sorted({os.getpriority(os.PRIO_PROCESS, int(t))
                       for t in os.listdir("/proc/self/task")})

    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)  # an error must not hang the child
    early.start()  # created at the parent's niceness, then raised below like Ray's workers
    for t in os.listdir("/proc/self/task"):
        os.setpriority(os.PRIO_PROCESS, int(t), start)
    late = threading.Thread(target=stop.wait, daemon=True)
    late.start()  # inherits START from the main thread
    raised = every_thread()
    res = priority.set_niceness(target)
    after = every_thread()
    newer = []
    t = threading.Thread(target=lambda: newer.append(priority.current_niceness()))
    t.start(); t.join()
    again = priority.reapply()
    stop.set(); early.join(); late.join()
    print(json.dumps({"raised": raised, "after": after, "newer": newer,
                      "before": res.before, "res_after": res.after, "threads": res.threads,
                      "error": res.error, "again_error": again.error}))
""")
LINUX_THREADS = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                   reason="per-thread niceness is Linux's (/proc/self/task)")


def _child(start: int, target: int, drop: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(start), str(target),
                           "drop" if drop else "keep"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["raised"] == [start] and out["before"] == start and out["threads"] >= 3, out
    return out


@LINUX_THREADS
def test_set_niceness_reaches_every_thread():
    """Raising niceness needs no privilege, so this runs the same as root and not."""
    out = _child(3, 7)
    assert out["error"] is None and out["again_error"] is None, out
    assert out["after"] == [7] and out["res_after"] == 7
    assert out["newer"] == [7]  # threads started later inherit it


@LINUX_THREADS
def test_lowering_without_privilege_is_reported_not_raised():
    """Without root or CAP_SYS_NICE (a root run drops both in the child), the result says
    why and the threads keep their niceness."""
    out = _child(7, 0, drop=True)
    assert "CAP_SYS_NICE" in out["error"] and "from 7 to 0" in out["error"], out
    assert out["after"] == [7] and out["res_after"] == 7


@LINUX_THREADS
def test_lowering_to_zero_reaches_every_thread_with_privilege():
    if os.geteuid() != 0:
        pytest.skip("lowering niceness needs root or CAP_SYS_NICE: run the tests as root "
                    "(.ci/run does)")
    out = _child(7, 0)
    assert out["error"] is None and out["again_error"] is None, out
    assert out["after"] == [0] and out["res_after"] == 0
    assert out["newer"] == [0]


def test_niceness_out_of_range_is_refused_before_any_change():
    from ray_mesh.core import priority

    with pytest.raises(ValueError, match="between -20 and 19"):
        priority.set_niceness(40)


@pytest.mark.parametrize("bad", [True, "0", 20, -21, 1.5])
def test_meshconfig_rejects_bad_worker_niceness_on_the_driver(bad):
    with pytest.raises(ValueError, match="worker_niceness must be an int from -20 to 19"):
        ray_mesh.MeshConfig(worker_niceness=bad)


def test_meshconfig_niceness_defaults_to_torchrun_like_zero_and_none_keeps_ray():
    assert ray_mesh.MeshConfig().worker_niceness == 0
    assert ray_mesh.MeshConfig(worker_niceness=None).to_dict()["worker_niceness"] is None
