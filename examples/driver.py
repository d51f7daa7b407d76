"""The hsdp example from a plain Python driver: TorchTrainer + ray_mesh.MeshConfig.

    python examples/driver.py                        # embedded local Ray, 4 CPU workers
    python examples/driver.py --address 100.64.0.1:6379 --gpu --workers 8 \
        --storage-path s3://ray-mesh/runs --storage-endpoint http://100.64.0.1:9000

Nodes that share no filesystem need storage every node writes (Ray Train keeps the run's
results there): a bucket (``--storage-path s3://...``; ``--storage-endpoint`` for MinIO or
``ray-mesh storage serve``) or a shared mount. Without ``--storage-path``: ``~/ray_results``.
"""

from __future__ import annotations

import argparse
import os

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ray_mesh
from ray_mesh.raytrain.driver import CLI_ENV

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", default=None, help="Ray cluster (default: embedded)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--storage-path", default=None,
                        help="where Ray Train keeps the run (default ~/ray_results)")
    parser.add_argument("--storage-endpoint", default=None,
                        help="URL of an S3-compatible server for an s3:// storage path")
    args = parser.parse_args()

    # The Ray Train settings `ray-mesh run` uses (a value you exported wins): prints once,
    # the controller looks at the workers every 0.2 s, no preemption watcher (docs/monitoring.md).
    for key, value in CLI_ENV.items():
        os.environ.setdefault(key, value)
    # working_dir ships this folder to every worker, so they can import hsdp.train_loop.
    runtime_env = {"working_dir": HERE}
    if args.address:
        # Hides a deprecation warning Ray Train's own controller raises (Ray 2.60).
        runtime_env["worker_process_setup_hook"] = "ray_mesh.raytrain.driver.cluster_worker_setup"
        ray.init(address=args.address, runtime_env=runtime_env)
    else:
        # An embedded Ray shares the machine with any other Ray on it: this hook (the one
        # `ray-mesh run` uses) points every process of this instance at it, or Ray Train's
        # own actors fail to pick one with a traceback (ray_mesh.raytrain.driver).
        runtime_env["worker_process_setup_hook"] = "ray_mesh.raytrain.driver.embedded_worker_setup"
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.workers),
                 runtime_env=runtime_env)
    from hsdp import train_loop  # noqa: E402  (importable once working_dir is on the path)

    scaling = ScalingConfig(num_workers=args.workers, use_gpu=args.gpu)
    # Replicate across nodes, shard inside a node: resolved on the real topology.
    mesh_config = ray_mesh.MeshConfig(mesh=ray_mesh.MeshSpec(dp_replicate=2, dp_shard=-1),
                                      total_steps=args.steps)  # the progress line's /N, ETA
    # What only the driver can check (it needs the ScalingConfig): resources (Ray would wait
    # forever for GPUs a CPU-only cluster lacks) and the mesh against the worker count.
    ray_mesh.check_cluster(scaling, mesh_config)
    # Storage every node can write (or a bucket that answers), checked before any worker.
    storage = ray_mesh.check_storage(args.storage_path, name="hsdp-driver",
                                     endpoint=args.storage_endpoint)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": args.steps},
        scaling_config=scaling,
        torch_config=mesh_config,
        # Bounded start-up retries: Ray retries a group that cannot start forever by default.
        run_config=RunConfig(name="hsdp-driver",
                             failure_config=FailureConfig(controller_failure_limit=3),
                             **ray_mesh.run_storage(storage, args.storage_endpoint)),
    )
    result = trainer.fit()
    print(f"driver: finished, results in {result.path}")


if __name__ == "__main__":
    main()
