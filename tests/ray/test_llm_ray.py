"""The llm job through `ray-mesh run`: Ray Data streams packed rows to the workers.

A dp-only mesh (dp_shard 4, tp 1), where Ray's own split over the workers is the split by dp
rank, so this runs correctly on Ray 2.60 as is. (With tp > 1, Ray's default split gives tp
peers different rows and the example's peer guard stops the run at step 0; the dp-aware
split is the data section's other half.) Checks: the run finishes, the train function got the
job's config and data section, the loss falls, and a sharded checkpoint was registered.
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

JOB = """\
name: llm_ray_test
train: {root}/examples/llm.py:train_loop
config:
  model: {{preset: tiny, max_seq_len: 64}}
  steps: 8
  warmup: 2
  report_every: 4
  eval_every: 8
  checkpoint_every: 8
data:
  paths: [stdlib]
  seq_len: 32
  batch_size: 8
  max_tokens: 60000
  val_tokens: 4096
mesh: {{dp_shard: -1, tp: 1}}
scaling: {{num_workers: 4, resources_per_worker: {{CPU: 1}}}}
run: {{storage_path: {storage}}}
"""


@pytest.mark.timeout(600)
def test_ray_mesh_run_llm_streams_ray_data(tmp_path):
    job = tmp_path / "llm.yaml"
    job.write_text(JOB.format(root=ROOT, storage=tmp_path / "results"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    ray_tmp = tempfile.mkdtemp(prefix="rm-", dir="/tmp")  # short unix socket paths
    env["RAY_TMPDIR"] = ray_tmp
    try:
        proc = subprocess.run([sys.executable, "-m", "ray_mesh.cli.main", "run", str(job)],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=540)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "rows from Ray Data, start step 0, 8 steps, reports every 4" in out, out[-5000:]
    losses = [float(x) for x in re.findall(r"llm: step \d+/8 loss ([0-9.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0], losses
    assert re.search(r"val bits/byte [0-9.]+ \(unigram entropy [0-9.]+ bits/byte\)", out)
    assert "checkpoint_step=8" in out, out[-3000:]
    assert list((tmp_path / "results" / "llm_ray_test").glob("checkpoint_00000008*"))
