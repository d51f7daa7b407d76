"""One ``TorchTrainer.fit`` of a train file from tests/helpers, for the Ray checkpoint tests.

Checkpoint and DiLoCo tests run the same shape of fit (a train function loaded by path,
CPU workers, a MeshConfig, a storage path, a failure budget, kept checkpoints) many times;
this is that fit, printing its wall time so a slow CI run shows where time went.
"""

from __future__ import annotations

import time
from typing import Any


def fit(train: str, name: str, storage: str, config: dict, *, workers: int,
        mesh_config: Any, max_failures: int = 0, num_to_keep: int = 3) -> Any:
    """Run ``train`` ("path.py:function") with ``config``; returns Ray Train's Result."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mesh.cli.job import load_function

    trainer = TorchTrainer(
        load_function(train),
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        torch_config=mesh_config,
        run_config=RunConfig(name=name, storage_path=storage,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep)),
    )
    t0 = time.monotonic()
    result = trainer.fit()
    print(f"fit {name}: {time.monotonic() - t0:.1f} s")
    return result
