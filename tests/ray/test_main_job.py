"""The README's main job, `ray-mesh run examples/hsdp.yaml`, on an embedded local Ray."""

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

pytestmark = pytest.mark.ray


@pytest.mark.timeout(600)
def test_ray_mesh_run_hsdp_example(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # Its own embedded Ray, apart from the test session's. A short path: Ray's unix socket
    # paths under it must stay below 107 bytes, which pytest's tmp_path can exceed.
    ray_tmp = tempfile.mkdtemp(prefix="rm-", dir="/tmp")
    env["RAY_TMPDIR"] = ray_tmp
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ray_mesh.cli.main", "run", "examples/hsdp.yaml"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "ray-mesh: run 'hsdp' finished" in out
    # Rank 0 printed the layout table once (Ray may echo a line twice; the header is unique).
    assert re.search(r"ray_mesh: MeshSpec\(pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1\)", out)
    losses = [float(x) for x in re.findall(r"hsdp: step \d+/\d+ loss ([0-9.]+)", out)]
    assert len(losses) >= 2, out[-4000:]
    assert losses[-1] < 0.5 * losses[0], losses
