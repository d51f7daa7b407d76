"""The hang watch on real Ray: 4 workers, dp_shard=2 x tp=2, rank 3 skips a dp all_reduce."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.ray

HANG_TIMEOUT_S = 10.0


# Slow tier (~45 s): the hang report itself (a skipped collective named with stacks, in
# bounded time) is checked under torchrun in the default tier (tests/dist/test_hang_torchrun.py).
@pytest.mark.slow
@pytest.mark.timeout(480)  # Ray start-up on a busy 2-core machine; the bound is below
def test_run_ends_with_the_hang_report(ray_local, storage, tmp_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh
    from harness.hang_train import hang_loop

    trainer = TorchTrainer(
        hang_loop,
        train_loop_config={"skip_step": 3, "skip_rank": 3, "out_dir": str(tmp_path),
                           "sleep_s": 600},
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
        torch_config=ray_mesh.MeshConfig(mesh={"dp_shard": 2, "tp": 2},
                                         hang_timeout_s=HANG_TIMEOUT_S),
        run_config=RunConfig(storage_path=storage, name="hang"),
    )
    with pytest.raises(Exception) as err:
        trainer.fit()
    ended = time.time()
    hang_start = json.loads((tmp_path / "hang_start.json").read_text())["t"]
    assert ended - hang_start < HANG_TIMEOUT_S + 30, ended - hang_start
    # What Ray Train shows (its first and last 500 characters): the error type and summary.
    shown = str(err.value)
    assert "CollectiveHangError" in shown and "ray_mesh: collective hang" in shown, shown
    assert "Hang summary: all_reduce #4 on mesh dim 'dp_shard'" in shown or \
        "rank 3 did not arrive" in shown, shown
    # The full report is the waiting ranks' error.
    failures = err.value.worker_failures
    assert {0, 1, 2} <= set(failures), failures
    report = str(failures[1])
    assert type(failures[1]).__name__ == "CollectiveHangError", report
    assert "on mesh dim 'dp_shard' (same group as dp" in report
    assert "did not arrive: rank 3 (at #3)" in report
    assert "NOT in any collective" in report
    assert "in stuck_in_user_code" in report and "time.sleep(seconds)" in report
