"""Checkpoints through Ray Train: recovery from a SIGKILLed worker, corrupt checkpoints, storage.

Real local Ray (the shared ``ray_local`` fixture), 4 CPU workers with gloo, HSDP 2x2, FSDP2,
direct mode with ``dcp.async_save``: on the first attempt rank 1 flips one bit in the middle
of a shard of the newest registered checkpoint (its length stays: only the checksum finds
it) and SIGKILLs itself while the next one is half written; ``FailureConfig(max_failures=1)``:
Ray restarts the group, which skips the corrupt and the partial checkpoint (with warnings)
and resumes from the one before. A ``checkpoint_000005`` another tool left in the run
directory is never deleted.

The run uses dropout: it must end with parameters bitwise equal to the same training
uninterrupted, which needs each rank's random state restored with the checkpoint. That
reference is 4 ranks forked on this host without Ray (tests/helpers/_ckpt_reference.py,
beside the run): bitwise what an uninterrupted fit ends with. It replaced an uninterrupted
fit in upload mode (~25 s of Ray Train bring-up); the upload mode (each rank's shards staged
locally, merged by Ray) is what a run to a bucket uses, killed and resumed bitwise in the
default tier on the WireGuard cluster (tests/netns/test_checkpoint_netns.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from ckpt_reference_run import reference_beside
from ray_fit import fit

from harness.ckpt_train import attempts, steps
from ray_mesh.checkpointing import StorageError, check_storage, sharded
from ray_mesh.cli.job import Job

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "harness" / "ckpt_train.py") + ":train_loop"
STEPS = 12
EVERY = 3


def _fit(name: str, storage: str, config: dict, max_failures: int = 0):
    import ray_mesh

    return fit(TRAIN, name, storage, {"steps": STEPS, "every": EVERY, **config}, workers=4,
               mesh_config=ray_mesh.MeshConfig(mesh={"dp_replicate": 2, "dp_shard": 2}),
               max_failures=max_failures)



def _assert_bitwise(a: Path, b: Path) -> None:
    sa, sb = torch.load(a), torch.load(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{k} differs from the uninterrupted run"


@pytest.mark.ray
def test_kill_resume_corrupt_bitwise(ray_local, tmp_path, monkeypatch):
    # A worker's report waits for the controller to take it; the controller looks every
    # 2 s by default, which would make each step here take 2 s.
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    storage = str(tmp_path / "results")

    # Async saves; at step 10 rank 1 flips a bit in a shard of checkpoint 6 (the newest one
    # Ray has registered; checkpoint 9 is still being written, without marker) and SIGKILLs
    # itself. Ray restarts the group; 6 is skipped as corrupt, 9 is not complete: step 3.
    log = tmp_path / "kill.log"
    run_dir = Path(storage) / "killed"
    foreign = run_dir / "checkpoint_000005"  # e.g. Ray Tune's, not ray_mesh's
    foreign.mkdir(parents=True)
    (foreign / "model.pt").write_text("not ray_mesh's")
    cfg = {"async_save": True, "kill_at": 10, "kill_marker": str(tmp_path / "killed"),
           "corrupt": str(run_dir / "checkpoint_00000006_*"), "corrupt_mode": "flip",
           "dropout": 0.3, "log": str(log), "final": str(tmp_path / "kill.pt")}
    # The uninterrupted reference, without Ray, beside the run (see the module docstring).
    with reference_beside(tmp_path / "ref.pt", tmp_path, steps=STEPS):
        res = _fit("killed", storage, cfg, max_failures=1)
    assert res.error is None
    assert (tmp_path / "killed").exists()
    first, second = attempts(log)
    print("attempt 1:", first, "\nattempt 2:", second)
    # async: the checkpoint of step 3k is completed and reported at step 3k+1
    assert [int(x.split()[3]) for x in first if " ckpt " in x] == [3, 6], first
    assert steps(first) == list(range(1, 10)), first
    assert second[0].startswith("start 3 checkpoint_00000003_"), second
    # no gap, and nothing at or before the checkpoint resumed from is repeated
    assert steps(second) == list(range(4, STEPS + 1)), second
    _assert_bitwise(tmp_path / "ref.pt", tmp_path / "kill.pt")
    # num_to_keep=3 kept the newest three (6, 9, 12 of the second attempt); the partial
    # step-9 directory of the first attempt was removed at the restart; the foreign
    # checkpoint_000005 is untouched.
    kept = sorted((sharded.step_of(p), p) for p in run_dir.iterdir() if sharded.step_of(p))
    assert [s for s, _ in kept] == [5, 6, 9, 12], kept
    assert all(sharded.problem(p, verify=True) is None for _, p in kept[1:])
    assert (foreign / "model.pt").read_text() == "not ray_mesh's"


@pytest.mark.ray
def test_storage_checked_at_start(ray_local, tmp_path):
    from ray_mesh.cli.runner import run_job

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = str(blocker / "results")
    with pytest.raises(StorageError, match="is not writable") as err:
        check_storage(bad)
    assert bad in str(err.value)
    # The runner refuses it before any worker starts.
    job = Job.from_dict({"train": TRAIN, "mesh": "ddp", "scaling": {"num_workers": 2},
                         "run": {"storage_path": bad}})
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="is not writable"):
        run_job(job)
    assert time.monotonic() - t0 < 30
    # A good local path on a one-node Ray: accepted, made absolute, no probe left behind.
    good = check_storage(tmp_path / "ok")
    assert Path(good).is_absolute() and list(Path(good).iterdir()) == []
