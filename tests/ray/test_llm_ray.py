"""The llm job through `ray-mesh run`: Ray Data streams packed rows to the workers.

1. A dp-only mesh (dp_shard 4, tp 1): the run finishes, the train function got the job's
   config and data section, the loss falls, and a sharded checkpoint was registered.
2. dp_shard 2 x tp 2: ``MeshConfig`` makes the job's datasets split by dp rank
   (``MeshDataConfig``), so both tp peers of a dp rank read the same rows. The example's
   peer guard (``check_same_batch``, at every step here) raises on the first step whose
   batches differ between tp peers -- as Ray's default split by world rank gives -- so a
   finished run is the proof; the loss must be finite and fall.
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


def _run(tmp_path: Path, mesh: str, steps: int, report: int, address: str | None = None
         ) -> str:
    """``ray-mesh run`` of the job on an embedded Ray, or on the Ray at ``address``; its
    checked output."""
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
    if address:
        cmd += ["--address", address]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=540)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    check_run(out, name="llm_ray_test", steps=steps, report=report, storage=storage)
    return out


@pytest.mark.slow  # the tp=2 case below runs the same path (and more) in the default tier
@pytest.mark.timeout(600)
def test_ray_mesh_run_llm_streams_ray_data(tmp_path):
    out = _run(tmp_path, "{dp_shard: -1, tp: 1}", steps=8, report=4)
    assert "(dp 4 x tp 1)" in out, out[-3000:]


@pytest.mark.timeout(600)
def test_llm_tp2_peers_read_identical_ray_data_batches(ray_local, tmp_path):
    # On the session's Ray (``--address``), not an embedded one of its own: a Ray start and
    # its dashboard cost ~15 s here; the embedded path is tests/ray/test_main_job.py's.
    address = ray_local.get_runtime_context().gcs_address
    out = _run(tmp_path, "{dp_shard: 2, tp: 2}", steps=6, report=2, address=address)
    assert "(dp 2 x tp 2)" in out, out[-3000:]
