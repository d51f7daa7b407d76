"""The parallel examples end to end: ``ray-mesh run examples/NAME.yaml`` on an embedded Ray.

Opt-in (``RAY_MESH_SLOW_TESTS=1``): each run starts its own local Ray and 4 or 8 workers,
1.5-4 minutes apiece on a busy 2-core machine. The examples' models and parallel layouts are
already checked against a single process in ``test_parallel_ray.py``; this checks the jobs
as a user runs them: exit code, the loss going down, and the blog model's output shape.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tp_pp_mlp", "fsdp_tp_transformer", "pp_hsdp_tp", "hsdp"])
def test_example_job_trains(name):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Its own embedded Ray, in a short dir: Ray's socket paths must stay under 107 bytes,
    # which pytest's tmp_path (pytest-of-root/pytest-NN/test_..._name_0/...) can exceed.
    tmp = tempfile.mkdtemp(prefix="rmex", dir="/tmp")
    env["RAY_TMPDIR"] = tmp
    proc = subprocess.run(
        [sys.executable, "-m", "ray_mesh.cli.main", "run", f"examples/{name}.yaml"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=570)
    shutil.rmtree(tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert f"ray-mesh: run '{name}' finished" in out
    losses = [float(x) for x in re.findall(rf"{name}: step \d+/\d+ loss ([0-9.]+)", out)]
    assert len(losses) >= 2, out[-4000:]
    assert losses[-1] < 0.75 * losses[0], losses
    if name == "tp_pp_mlp":
        assert re.search(r"\(last stage\): final output shape \(32, 4\)", out), out[-4000:]
