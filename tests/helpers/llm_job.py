"""The llm example as a short job file, and the checks of its output, shared by the local Ray
tests (tests/ray/test_llm_ray.py; check_run also by tests/ray/test_console_examples.py) and
the virtual-cluster test (tests/netns/test_llm_netns.py).

Tiny preset, byte rows of 32 tokens from the standard library's sources through the job's
``data:`` section (Ray Data), and ``check_peer_batches: 1``: the example compares the batch
over the tp group at every step and raises if tp peers got different rows, so a finished run
on a tp > 1 mesh is the proof that Ray Data was split by dp rank.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

JOB = """\
name: {name}
train: {root}/examples/llm.py:train_loop
config:
  model: {{preset: tiny, max_seq_len: 64}}
  steps: {steps}
  warmup: 2
  report_every: {report}
  eval_every: {steps}
  checkpoint_every: {steps}
  check_peer_batches: 1
data:
  paths: [stdlib]
  seq_len: 32
  batch_size: 8
  max_tokens: 60000
  val_tokens: 4096
mesh: {mesh}
scaling: {{num_workers: 4, resources_per_worker: {resources}}}
run: {{storage_path: {storage}{endpoint}}}
"""


def write_job(path: Path, *, name: str, mesh: str, steps: int, report: int,
              storage: Path | str, resources: str = "{CPU: 1}",
              endpoint: str | None = None) -> Path:
    """``storage``: a directory or an ``s3://`` URI; ``endpoint``: its S3 server's URL."""
    path.write_text(JOB.format(name=name, root=REPO, mesh=mesh, steps=steps, report=report,
                               storage=storage, resources=resources,
                               endpoint=f", storage_endpoint: {endpoint}" if endpoint else ""))
    return path


def losses(out: str, steps: int) -> list[float]:
    """The training losses the example printed (rank 0), in step order."""
    # The progress line ray_mesh shows from each ray_mesh.report, named after the run.
    return [float(x) for x in re.findall(rf"[\w.-]+: step \d+/{steps} loss ([0-9.naif]+)",
                                         out)]


def check_run(out: str, *, name: str, steps: int, report: int,
              storage: Path | None) -> list[float]:
    """Asserts a finished run read Ray Data, trained (finite, falling loss) and registered a
    sharded checkpoint at its last step (looked for in ``storage`` when it is a directory
    here; a bucket's caller lists it itself); returns the losses."""
    assert f"rows from Ray Data, start step 0, {steps} steps, reports every {report}" in out, \
        out[-5000:]
    assert "got different batches" not in out, out[-5000:]
    got = losses(out, steps)
    assert len(got) >= 3 and all(math.isfinite(x) for x in got), got
    assert got[-1] < got[0], got
    assert re.search(r"val bits/byte [0-9.]+ \(unigram entropy [0-9.]+ bits/byte\)", out)
    assert f"checkpoint_step={steps}" in out, out[-3000:]
    if storage is not None:
        assert list((storage / name).glob(f"checkpoint_{steps:08d}*")), \
            sorted(storage.rglob("*"))
    return got
