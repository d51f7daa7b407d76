"""Metrics overhead (section e): an example's training step in a ray_mesh (Ray Train) run.

Same model and HSDP mesh as the step benchmark (``paired.py``); timing windows
(``workloads.time_windows``) alternate with and without ray_mesh's report bookkeeping on every
step (``ReportRecorder.observe``: what ``ray_mesh.report`` adds to ``ray.train.report``, without the
report's own wait for Ray Train's controller).
"""

from __future__ import annotations

import time

from benchmarks.common import read_result, result_path, write_result


def _train_steps(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    import ray_mesh
    from benchmarks import workloads

    state = ray_mesh.get_state()
    _spec, factory = workloads.WORKLOADS[config["workload"]]
    step = factory(state.mesh, state.device, config["batch"])
    meter_factory = None
    if config.get("metrics"):
        from ray_mesh.observability.export import Exporter
        from ray_mesh.observability.report import ReportRecorder

        def meter_factory():
            return ReportRecorder(Exporter(loud=True))
    out = workloads.time_windows(step, warmup=config["warmup"], windows=config["windows"],
                                 steps_per_window=config["steps_per_window"],
                                 meter_factory=meter_factory,
                                 metered_first=config.get("metered_first", False))
    if meter_factory is not None:
        out["empty_step_us"] = _empty_meter_steps(meter_factory)
    if dist.get_rank() == 0:
        write_result(config["out"], out)
    ray.train.report({"done": 1})


def _empty_meter_steps(meter_factory, n: int = 20000) -> float:
    """Microseconds one report's bookkeeping costs (``ReportRecorder.observe``). The recorder
    flushes every 2 s and these calls take far less in all: no flush falls in this figure."""
    rec = meter_factory()
    t0 = time.perf_counter()
    for i in range(n):
        rec.observe({"step": i, "loss": 0.5})
    per = (time.perf_counter() - t0) / n * 1e6
    rec.flush()
    return per


def metrics_available() -> bool:
    try:
        from ray_mesh.observability.report import ReportRecorder  # noqa: F401
    except ImportError:
        return False
    return True


def measure_ray(args: dict, workers: int, storage: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from benchmarks.workloads import WORKLOADS
    from ray_mesh import MeshConfig, MeshSpec

    out = result_path("steps")
    TorchTrainer(
        _train_steps,
        train_loop_config={**args, "out": out},
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        torch_config=MeshConfig(mesh=MeshSpec(**WORKLOADS[args["workload"]][0])),
        run_config=RunConfig(name=f"steps_{args['workload']}_{time.time_ns()}",
                             storage_path=storage),
    ).fit()
    return read_result(out)
