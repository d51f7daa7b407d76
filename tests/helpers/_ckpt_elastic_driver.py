"""Driver for the elastic checkpoint test; runs inside the namespace cluster's head node.

    python _ckpt_elastic_driver.py fixed|elastic|grow|storage <workdir>

Runs the checkpoint test's train function on 2 workers per node (custom resource ``slot``)
with an HSDP mesh whose dp_replicate follows the nodes. The test kills a node while it runs.
``fixed``: 4 workers, not elastic -> the restart cannot place them: an explained error.
``elastic``: (2, 4) workers -> the restart runs on what is left, from the last checkpoint.
``grow``: (2, 4) workers started on one node; the test adds a node and Ray's elastic
policy restarts the group at 4 workers, from the last checkpoint.
``storage``: a storage_path only the driver sees -> refused at start as node-local.
Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import ray
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import ray_mesh
from ray_mesh.checkpointing import StorageError, check_storage
from ray_mesh.cli.job import load_function
from ray_mesh.raytrain.elastic import check_elastic_mesh, explain_startup_failure, failure_config

HERE = Path(__file__).resolve().parent


def storage_refused(work: Path) -> dict:
    """A path only the driver's node has (the head's own disk) must be refused.

    ``/tmp/ray-mesh-node`` is private to each node of the virtual cluster
    (``harness.netns.namespaces``): what a local path is on a real multi-node cluster."""
    private = Path("/tmp/ray-mesh-node/ckpt_elastic")
    try:
        check_storage(str(private / "results"))
        return {"ok": True, "error": None}
    except StorageError as exc:
        return {"ok": False, "error": str(exc)}


def main(mode: str, work: Path) -> dict:
    ray.init(address="auto", log_to_driver=True)
    if mode == "storage":
        return storage_refused(work)
    spec = ray_mesh.MeshSpec.hsdp()
    elastic = mode in ("elastic", "grow")
    workers: int | tuple[int, int] = (2, 4) if elastic else 4
    if isinstance(workers, tuple):
        check_elastic_mesh(spec, *workers)
    # ``work`` is pytest's tmp_path, which every node of the virtual cluster sees: it
    # stands for a shared filesystem (NFS) until S3 storage (moto) is in the harness. The
    # shared-storage check must accept it.
    storage = check_storage(str(work / "results"))
    trainer = TorchTrainer(
        load_function(str(HERE.parents[1] / "harness" / "ckpt_train.py") + ":train_loop"),
        # grow: a long enough run for a node to join and the policy to notice it
        train_loop_config={"steps": 40 if mode == "grow" else 10, "every": 2,
                           "step_sleep": 2.5 if mode == "grow" else 1.5,
                           "log": str(work / f"{mode}.log"), "final": str(work / f"{mode}.pt"),
                           "upload": False},
        scaling_config=ScalingConfig(num_workers=workers,
                                     resources_per_worker={"CPU": 0.5, "slot": 1},
                                     # grow: look for new nodes every 5 s
                                     elastic_resize_monitor_interval_s=5 if mode == "grow"
                                     else 3600),
        torch_config=ray_mesh.MeshConfig(mesh=spec),
        run_config=RunConfig(name=mode, storage_path=storage,
                             # elastic: the first restart may still count the dead node
                             failure_config=failure_config(
                                 2, startup_retries=3 if elastic else 1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    try:
        result = trainer.fit()
        return {"ok": result.error is None, "error": repr(result.error)}
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                "explained": explain_startup_failure(exc, workers),
                "trace": traceback.format_exc()[-3000:]}


if __name__ == "__main__":
    out = main(sys.argv[1], Path(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
