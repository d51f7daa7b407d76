"""Bring-up: ``fit()`` (or the torchrun launch) to "mesh ready on every rank".

Three ways to the same HSDP mesh (dp_replicate=2, dp_shard=N/2) on N CPU workers:

* ``plain``: ``TorchTrainer`` with Ray's own ``TorchConfig`` (it makes the process group);
  the train function calls ``init_device_mesh`` itself with only the dims it needs.
* ``ray_mesh``: ``TorchTrainer(torch_config=MeshConfig(...))`` with its defaults
  (probe, plan, pre-flight, every named dim); the mesh is ready when the train function
  starts.
* ``torchrun``: ``torchrun`` + ``init_process_group`` + ``init_device_mesh``.
* ``ray_mesh_nopf``: ``MeshConfig(preflight=False)``, to show what the pre-flight costs.

The ready time is the latest rank's ``time.time()`` minus the driver's clock just before
``fit()`` / the launch (one machine, one clock).
"""

from __future__ import annotations

import time

from benchmarks.common import read_result, result_path, run_torchrun, write_result


def _train_plain(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    from benchmarks import workloads

    t0 = time.time()
    workloads.plain_hsdp_mesh(dist.get_world_size())
    now = time.time()
    figures = workloads.ready_figures(now, now - t0)
    if dist.get_rank() == 0:
        write_result(config["out"], figures)
    ray.train.report({"done": 1})


def _train_ray_mesh(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    import ray_mesh
    from benchmarks import workloads

    ray_mesh.get_mesh()
    figures = workloads.ready_figures(time.time())
    if dist.get_rank() == 0:
        write_result(config["out"], figures)
    ray.train.report({"done": 1})


def _fit(mode: str, workers: int, storage: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from ray_mesh import MeshConfig, MeshSpec

    if mode == "plain":
        fn, torch_config = _train_plain, TorchConfig(backend="gloo")
    else:
        fn = _train_ray_mesh
        torch_config = MeshConfig(mesh=MeshSpec(dp_replicate=2, dp_shard=-1),
                                  preflight=mode != "ray_mesh_nopf")
    out = result_path("bringup")
    trainer = TorchTrainer(
        fn,
        train_loop_config={"out": out},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        torch_config=torch_config,
        run_config=RunConfig(name=f"bringup_{mode}_{workers}_{time.time_ns()}",
                             storage_path=storage),
    )
    start = time.time()
    trainer.fit()
    fit_s = time.time() - start
    metrics = read_result(out)
    return {"ready_s": metrics["ready_wall_max"] - start, "fit_s": fit_s,
            **{k: v for k, v in metrics.items() if k.startswith(("rank0_", "mesh_build"))}}


def measure(mode: str, workers: int, storage: str) -> dict:
    """One bring-up of ``mode`` on ``workers`` ranks."""
    if mode == "torchrun":
        r = run_torchrun(workers, "ready", {})
        return {"ready_s": r["ready_wall_max"] - r["launch_wall"],
                "fit_s": r["process_wall_s"],
                **{k: v for k, v in r.items() if k.startswith(("rank0_", "mesh_build"))}}
    return _fit(mode, workers, storage)


MODES = ("plain", "ray_mesh", "torchrun", "ray_mesh_nopf")
