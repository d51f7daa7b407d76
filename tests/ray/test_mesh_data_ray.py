"""Ray Data follows the mesh: dp ranks split the data, tp/cp/pp peers read identical batches.

Real local Ray (the shared ``ray_local`` fixture), CPU workers with gloo, a dataset of row ids
(``ray.data.range``) and a torch DataLoader over the same ids. Every rank logs the ids of every
step (``_data_train.py``). Checked: peers (same dp index) see identical ids at every step, and
per epoch the dp ranks' ids are disjoint and together the whole dataset, exactly once.

1. dp_shard 2 x tp 2 with the trainer's default ``DataConfig`` (made mesh-aware by
   ``MeshConfig``'s backend; before that change the tp peers got different rows);
2. pp 2 x dp_shard 2 x tp 2 with the explicit ``dataset_config=MeshDataConfig()``;
3. run 1 again with checkpoints and exact data positions, rank 1 SIGKILLed mid-epoch: after
   the resume every rank reads, step for step, what run 1 read.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from _data_train import read_records

from ray_mesh.cli.job import load_function

TRAIN = str(Path(__file__).resolve().parents[1] / "helpers" / "_data_train.py") + ":train_loop"
ROWS, BATCH, EPOCHS = 48, 4, 2


def _fit(out: Path, mesh: dict, workers: int, storage: str, *, dataset_config=None,
         max_failures: int = 0, **config):
    import ray.data
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh

    out.mkdir(parents=True, exist_ok=True)
    # Half a CPU per worker leaves CPUs to Ray Data's read tasks on the 8-CPU local Ray.
    kwargs = {"dataset_config": dataset_config} if dataset_config is not None else {}
    trainer = TorchTrainer(
        load_function(TRAIN),
        train_loop_config={"rows": ROWS, "batch": BATCH, "epochs": EPOCHS, "out": str(out),
                           **config},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 0.5}),
        torch_config=ray_mesh.MeshConfig(mesh=mesh),
        datasets={"train": ray.data.range(ROWS, override_num_blocks=6)},
        run_config=RunConfig(name=out.name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures)),
        **kwargs,
    )
    result = trainer.fit()
    assert result.error is None
    return read_records(out)


def _check(records: list[dict], dp: int, peers: int) -> dict[tuple[int, int], dict]:
    """Assert the split; returns {(step, dp index): record} of one peer per dp index."""
    by_step: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in records:
        by_step[(r["step"], r["dp"])].append(r)
    for (step, d), group in sorted(by_step.items()):
        assert len(group) == peers, (step, d, group)
        for source in ("ray", "torch"):
            seen = {tuple(r[source]) for r in group}
            assert len(seen) == 1, f"step {step}, dp {d}: peers read different {source} ids " \
                                   f"{sorted(seen)} (ranks {[r['rank'] for r in group]})"
    steps = ROWS // dp // BATCH * EPOCHS
    assert sorted({s for s, _ in by_step}) == list(range(1, steps + 1))
    for epoch in range(EPOCHS):
        for source in ("ray", "torch"):
            ids = [i for (_, d), g in by_step.items() if g[0]["epoch"] == epoch
                   for i in g[0][source]]
            assert sorted(ids) == list(range(ROWS)), (epoch, source, sorted(ids))
    return {key: group[0] for key, group in by_step.items()}


@pytest.fixture(scope="module")
def plain_run(ray_local, tmp_path_factory):
    """Run 1: dp_shard 2 x tp 2, the trainer's default DataConfig, no checkpoints."""
    tmp = tmp_path_factory.mktemp("mesh_data")
    return _fit(tmp / "plain", {"dp_shard": 2, "tp": 2}, 4, str(tmp / "results"))


@pytest.fixture(autouse=True)
def _fast_controller(monkeypatch):
    # Reports wait for the controller's poll (2 s by default).
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")


# Slow tier (~45 s of fit): the same default path (MeshConfig makes the trainer's datasets
# split by dp rank) is what the llm example's run in tests/ray/test_console_examples.py
# proves in the default tier.
@pytest.mark.slow
@pytest.mark.ray
def test_default_data_config_follows_mesh(plain_run):
    _check(plain_run, dp=2, peers=2)


@pytest.mark.ray
@pytest.mark.slow  # 8 workers on 2 cores (2-4 min); the 4-worker cases stay in the default suite
def test_explicit_mesh_data_config_pp_tp(ray_local, tmp_path):
    import ray_mesh

    records = _fit(tmp_path / "pp", {"pp": 2, "dp_shard": 2, "tp": 2}, 8,
                   str(tmp_path / "results"), dataset_config=ray_mesh.MeshDataConfig())
    _check(records, dp=2, peers=4)


# Slow tier (~65 s: a SIGKILLed worker and a restart): the data position's arithmetic is
# unit-tested (tests/unit/test_data_position.py), kill/resume under Ray in test_checkpoint_ray.
@pytest.mark.slow
@pytest.mark.ray
def test_kill_resume_reads_what_uninterrupted_run_read(plain_run, tmp_path):
    # Checkpoint every 2 steps; rank 1 dies at step 9 (epoch 1, 3rd batch): resume from
    # step 8, i.e. 2 batches into the second epoch.
    records = _fit(tmp_path / "killed", {"dp_shard": 2, "tp": 2}, 4, str(tmp_path / "results"),
                   max_failures=1, resumable=True, every=2, kill_at=9,
                   kill_marker=str(tmp_path / "killed_marker"))
    assert (tmp_path / "killed_marker").exists()
    first = [r for r in records if r["attempt"] == 0]
    second = [r for r in records if r["attempt"] != 0]
    # resumed from checkpoint 8: mid-epoch (6 steps per epoch), 2 batches into epoch 1
    assert {r["attempt"] for r in second} == {8}, sorted({r["attempt"] for r in records})
    assert min(r["step"] for r in second) == 9
    assert min(r["epoch"] for r in second) == 1
    # What each rank read before the checkpoint, then after the resume, step for step:
    # exactly what the uninterrupted run read (none repeated, none skipped).
    kept = [r for r in first if r["step"] <= 8] + second
    reference = _check(plain_run, dp=2, peers=2)
    resumed = _check(kept, dp=2, peers=2)
    assert resumed.keys() == reference.keys()
    for key in sorted(reference):
        for source in ("ray", "torch"):
            assert resumed[key][source] == reference[key][source], (key, source)
    # The killed attempt, up to where it died, read the same as well (deterministic split).
    for r in first:
        assert r["ray"] == reference[(r["step"], r["dp"])]["ray"], r
