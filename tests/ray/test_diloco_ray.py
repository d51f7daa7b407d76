"""DiLoCo through Ray Train: replicate section -> workers, per-replica checkpoints, kill/resume.

Real local Ray (the shared ``ray_local`` fixture), CPU workers with gloo, FSDP inside each
replica, DiLoCo every 3 steps over dp_replicate (int8), a checkpoint every 2 steps (so most
fall between syncs, when the replicas differ). Three fits of ``tests/helpers/_diloco_train.py``:

1. uninterrupted, 2 replicas x 2 shards;
2. the same, but rank 1 SIGKILLs itself at step 5; ``max_failures=1``: the group restarts
   from checkpoint 4 (between syncs) and must end bitwise equal to run 1 on every rank;
3. the run grows to 3 replicas: resumed from run 1's step-4 checkpoint on 3 x 1 workers, the
   third replica is not in it and starts from the global parameters; after the next sync
   all three replicas are bitwise equal and training goes on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ray_fit import fit

from harness.ckpt_train import attempts, steps
from ray_mesh.checkpointing import sharded

TRAIN = str(Path(__file__).resolve().parents[1] / "helpers" / "_diloco_train.py") + ":train_loop"
STEPS = 8
REPLICATE = {"mode": "diloco", "every": 3, "outer_lr": 0.7, "outer_momentum": 0.9,
             "compress": "int8"}


def _fit(name: str, storage: str, config: dict, mesh: dict, workers: int,
         max_failures: int = 0):
    import ray_mesh

    return fit(TRAIN, name, storage, {"steps": STEPS, "every": 2, **config}, workers=workers,
               mesh_config=ray_mesh.MeshConfig(mesh=mesh, replicate=REPLICATE,
                                               measure_links=False),
               max_failures=max_failures, num_to_keep=4)


@pytest.mark.ray
@pytest.mark.slow  # ~3 fits of 4-6 workers (4-10 min on 2 cores): the opt-in tier
@pytest.mark.timeout(1500)
def test_diloco_kill_resume_and_grow(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    storage = str(tmp_path / "results")
    hsdp = {"dp_replicate": 2, "dp_shard": 2}

    # 1. uninterrupted reference
    ref = _fit("reference", storage, {"log": str(tmp_path / "ref.log"),
                                      "final": str(tmp_path / "ref")}, hsdp, 4)
    assert ref.error is None
    (run,) = attempts(tmp_path / "ref.log")
    assert run[0].startswith("start 0 - replicas=2 inner=0 outer=0"), run[0]
    assert steps(run) == list(range(1, STEPS + 1))
    syncs = [line for line in run if " sync " in line]
    assert [int(s.split()[1]) for s in syncs] == [3, 6], syncs
    assert all("equal=True" in s for s in syncs), syncs
    last = json.loads(run[-1].split("metrics=", 1)[1].rsplit(" @", 1)[0])
    assert last["diloco/inner_step"] == 8 and last["diloco/outer_step"] == 2, last
    assert last["diloco/bytes_sent"] > 0 and last["diloco/drift"] > 0, last
    step4 = sorted(p for p in (Path(storage) / "reference").iterdir()
                   if sharded.step_of(p) == 4)
    assert step4, "checkpoint 4 was rotated out"

    # 2. SIGKILL at step 5 (checkpoint 4, between syncs, is the newest): resume, bitwise
    log = tmp_path / "kill.log"
    res = _fit("killed", storage, {"kill_at": 5, "kill_marker": str(tmp_path / "killed"),
                                   "log": str(log), "final": str(tmp_path / "kill")},
               hsdp, 4, max_failures=1)
    assert res.error is None
    first, second = attempts(log)
    assert steps(first)[:4] == list(range(1, 5)), first  # step 5 may be logged or not
    assert second[0].startswith("start 4 checkpoint_00000004_"), second[0]
    assert "inner=4 outer=1" in second[0], second[0]
    assert steps(second) == list(range(5, STEPS + 1)), second
    for rank in range(4):
        a = torch.load(tmp_path / f"ref.{rank}")
        b = torch.load(tmp_path / f"kill.{rank}")
        for k in a:
            assert torch.equal(a[k], b[k]), f"rank {rank} {k} differs from the uninterrupted run"

    # 3. grow to 3 replicas from run 1's step-4 checkpoint: replica 2 joins at the global params
    glog = tmp_path / "grow.log"
    grown = _fit("grown", storage, {"resume_from": str(step4[0]), "log": str(glog),
                                    "final": str(tmp_path / "grow")},
                 {"dp_replicate": 3, "dp_shard": 1}, 3)
    assert grown.error is None
    (run,) = attempts(glog)
    assert run[0].startswith("start 4 checkpoint_00000004_") and "replicas=3" in run[0], run[0]
    syncs = [line for line in run if " sync " in line]
    assert [int(s.split()[1]) for s in syncs] == [6], syncs
    assert all("equal=True" in s for s in syncs), syncs
