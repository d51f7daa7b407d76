"""The llm job through `ray-mesh run` on an embedded Ray: Ray Data streams packed rows to
the workers.

A dp-only mesh (dp_shard 4, tp 1), slow tier: the run finishes, the train function got the
job's config and data section, the loss falls, and a sharded checkpoint was registered. The
example as shipped (dp_shard 2 x tp 2, tp peers reading the same rows, checked at every
step) runs in the default tier in tests/ray/test_console_examples.py, with its console.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from llm_job import REPO, check_run, write_job


def _run(tmp_path: Path, mesh: str, steps: int, report: int) -> str:
    """``ray-mesh run`` of the job on an embedded Ray; its checked output."""
    storage = tmp_path / "results"
    job = write_job(tmp_path / "llm.yaml", name="llm_ray_test", mesh=mesh, steps=steps,
                    report=report, storage=storage)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    ray_tmp = tempfile.mkdtemp(prefix="rm-", dir="/tmp")  # short unix socket paths
    env["RAY_TMPDIR"] = ray_tmp
    # A report waits for the controller's next look at the workers, every 2 s by default
    # (Ray Train passes this on to its controller).
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    cmd = [sys.executable, "-m", "ray_mesh.cli.main", "run", str(job)]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=540)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    check_run(out, name="llm_ray_test", steps=steps, report=report, storage=storage)
    return out


@pytest.mark.slow  # the example's tp=2 case runs in test_console_examples.py (default tier)
@pytest.mark.timeout(600)
def test_ray_mesh_run_llm_streams_ray_data(tmp_path):
    out = _run(tmp_path, "{dp_shard: -1, tp: 1}", steps=8, report=4)
    assert "(dp 4 x tp 1)" in out, out[-3000:]
