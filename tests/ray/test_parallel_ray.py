"""Parallel layouts on local Ray (gloo) against a single-process reference.

One ``TorchTrainer.fit()`` on 8 workers (each fit costs 30-150 s on this shared 2-core
machine, so all layouts share one): the train function builds each layout on its own mesh
over the same workers (``tests/_parallel_checks.py``), trains a few SGD steps on the same
seed and data as one process, and compares every step's loss and every gathered parameter
(tolerance in that module: rtol 1e-4, atol 2e-5, float32). A layout that differs raises in
the workers, which fails the run; the driver also checks the differences every rank saved.

The 4-rank layouts run twice side by side on the 8 workers (an extra pp=2 that non-pipelined
layouts never touch, or an extra dp_replicate for pipelines run with data parallel off):
tp=2 (transformer, sequence parallel), HSDP 2x2 (hsdp example), DDP 4, DDP 2 x tp 2,
FSDP 2 x tp 2 (transformer example), pp=2 with GPipe / 1F1B / Interleaved1F1B / ZBV,
pp 2 x tp 2 (the blog layout, tp_pp_mlp's plan). Then on all 8: the 3-D layout pp 2 x
dp_shard 2 x tp 2 (pp_hsdp_tp example's build, interleaved 1F1B), and pipelines with HSDP 2x2
and with DDP 4 per stage.

Those layouts build their meshes inside the workers; a second, 4-worker fit checks the
path a user takes: ``MeshConfig(mesh=pp 2 x tp 2)`` builds the mesh, and a TP model and a
TP+PP pipeline train on ``ray_mesh.get_mesh()`` as it comes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
import _parallel_checks  # noqa: E402

pytestmark = pytest.mark.ray

FOUR = ["tp2", "hsdp2x2", "ddp4", "ddp2_tp2", "fsdp2_tp2", "pp2_gpipe", "pp2_1f1b",
        "pp2_interleaved_1f1b", "pp2_zbv", "pp2_tp2"]
EIGHT = ["pp2_fsdp2_tp2", "pp2_hsdp2x2", "pp2_ddp4"]


def _fit(fn, workers: int, storage: str, out: Path, mesh: dict | None = None):
    from ray import cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh

    # The workers cannot import tests/ by name: ship the check module with the function.
    cloudpickle.register_pickle_by_value(_parallel_checks)
    trainer = TorchTrainer(
        fn, train_loop_config={"out": str(out)},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        torch_config=ray_mesh.MeshConfig(mesh=mesh or {"dp_shard": -1}, bringup_timeout_s=240),
        run_config=RunConfig(name=f"parallel{workers}", storage_path=storage))
    return trainer.fit()


def _check(result, out: Path, workers: int, names: list[str]) -> None:
    assert result.error is None, result.error
    per_rank = [json.loads((out / f"{r}.json").read_text()) for r in range(workers)]
    for metrics, name in ((m, n) for m in per_rank for n in names):
        # The workers raised on any difference over the tolerance; these bounds are the
        # same tolerance seen from the driver, and "moved" shows training did something.
        assert metrics[f"{name}/param_diff"] <= 1e-4, (name, metrics)
        assert metrics[f"{name}/loss_diff"] <= 1e-4, (name, metrics)
        assert metrics[f"{name}/moved"] > 1e-3, (name, metrics)


# Slow tier (~55 s: every layout as a Ray fit): the same numerics are checked under torchrun
# (tests/dist/test_parallel_torchrun.py, test_llm_numerics.py); MeshConfig building TP and PP
# meshes under Ray stays in the default tier (test_tp_and_pp_on_the_mesh_meshconfig_builds).
@pytest.mark.slow
@pytest.mark.timeout(540)
def test_layouts_match_single_process(ray_local, storage, tmp_path):
    _check(_fit(_parallel_checks.train_all, 8, storage, tmp_path), tmp_path, 8, FOUR + EIGHT)


@pytest.mark.timeout(420)
def test_tp_and_pp_on_the_mesh_meshconfig_builds(ray_local, storage, tmp_path, monkeypatch):
    """The user's path on real Ray: MeshConfig(mesh=pp 2 x tp 2) brings the mesh up, the
    train function takes ``ray_mesh.get_mesh()`` as is and trains a TP model and a TP+PP
    pipeline on it (the test above builds its layouts' meshes inside the workers)."""
    # Ray Train's controller looks at the workers every 2 s by default (start and end wait).
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    result = _fit(_parallel_checks.meshconfig_checks, 4, storage, tmp_path,
                  mesh={"pp": 2, "tp": 2})
    _check(result, tmp_path, 4, ["mc_tp2", "mc_pp2_tp2"])
    rank0 = json.loads((tmp_path / "0.json").read_text())
    assert {d: rank0[f"mesh/{d}"] for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp")} == {
        "pp": 2, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2}, rank0

