"""ray_mesh.core.priority: every thread of a process gets the training niceness (Ray-free)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import ray_mesh

# Runs in a child process: it raises its own niceness (always allowed) the way Ray's core
# worker does, starts threads before and after, then asks ray_mesh for niceness 0.
CHILD = textwrap.dedent("""
    import json, os, threading
    from ray_mesh.core import priority

    def every_thread():
        return sorted({os.getpriority(os.PRIO_PROCESS, int(t))
                       for t in os.listdir("/proc/self/task")})

    stop = threading.Event()
    early = threading.Thread(target=stop.wait)
    early.start()  # created at niceness 0, then raised below like Ray's workers
    for t in os.listdir("/proc/self/task"):
        os.setpriority(os.PRIO_PROCESS, int(t), 7)
    late = threading.Thread(target=stop.wait)
    late.start()  # inherits 7 from the main thread
    raised = every_thread()
    res = priority.set_niceness(0)
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


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux per-thread niceness")
def test_set_niceness_reaches_every_thread():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["raised"] == [7]
    assert out["before"] == 7 and out["threads"] >= 3
    if os.geteuid() == 0:
        assert out["error"] is None and out["again_error"] is None
        assert out["after"] == [0] and out["res_after"] == 0
        assert out["newer"] == [0]  # threads started later inherit it
    else:  # lowering needs root or CAP_SYS_NICE: said, not raised
        assert "CAP_SYS_NICE" in out["error"]
        assert out["after"] == [7]


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
