"""Driver for the elastic checkpoint test; runs inside the namespace cluster's head node.

    python _ckpt_elastic_driver.py fixed|elastic|grow|storage|kill|diloco|probe <workdir> \
        <s3://bucket/runs> <endpoint>

Runs the checkpoint test's train function on 2 workers per node (custom resource ``slot``)
with an HSDP mesh whose dp_replicate follows the nodes. The test kills a node while it runs.
``fixed``: 4 workers, not elastic -> the restart cannot place them: an explained error.
``elastic``: (2, 4) workers -> the restart runs on what is left, from the last checkpoint.
``grow``: (2, 4) workers started on one node; the test adds a node and Ray's elastic
policy restarts the group at 4 workers, from the last checkpoint.
``storage``: a storage_path only the driver sees -> refused at start as node-local.
``kill``: 4 workers, 8 steps with dropout; rank 1 SIGKILLs itself at step 5 and the restart
resumes from the bucket (the test compares the final parameters with those of the same
training uninterrupted, tests/helpers/_ckpt_reference.py).
``diloco``: the same two runs (``diloco-ref``, ``diloco-kill``) with DiLoCo across the nodes
(outer step every 3 inner steps, FSDP inside each node): the restart resumes the outer state
(outer step, momentum, the global parameters) and each replica's state from the bucket.
``probe``: the driver's storage check as ``ray-mesh run`` makes it, twice: with the endpoint
on loopback (refused before any probe: every machine has its own), and with the real one
while the test drops node 1's packets to it (node 1's own probe fails; the node is named);
then ``fit_replica_groups`` with the bucket as its storage (the fallback checkpoints go
there) is refused the same way, naming node 1, before any group starts.
The runs store to the S3 bucket at the endpoint (the only storage every node reaches: the
nodes share no filesystem for it); the log and final parameters are the test's own files.
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
DILOCO = {"mode": "diloco", "every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}


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


def probe(storage_uri: str, endpoint: str) -> dict:
    """Both refusals' messages (None where the check passed)."""
    out = {}
    port = endpoint.rsplit(":", 1)[1]
    for what, url in (("loopback", f"http://127.0.0.1:{port}"), ("node", endpoint)):
        try:
            check_storage(storage_uri, endpoint=url, name="probe", timeout_s=5)
            out[what] = None
        except StorageError as exc:
            out[what] = str(exc)
    from ray_mesh.raytrain.replica_groups import fit_replica_groups

    try:  # refused before the coordinator or any group starts
        fit_replica_groups(lambda config: None, groups=2, workers_per_group=1, total_steps=1,
                           segment_samples=1, name="probe-groups", storage_path=storage_uri,
                           storage_endpoint=endpoint, checkpoint_every=1)
        out["groups"] = None
    except StorageError as exc:
        out["groups"] = str(exc)
    return {"ok": True, **out}


def _config(mode: str, work: Path) -> dict:
    files = {"log": str(work / f"{mode}.log"), "final": str(work / f"{mode}.pt")}
    if mode in ("kill", "diloco-ref", "diloco-kill"):
        kill = {"kill_at": 5, "kill_marker": str(work / f"{mode}ed")} \
            if mode.endswith("kill") else {}
        # bitwise: dropout draws, restored with the checkpoint (the DiLoCo train function has
        # its own dropout, and each rank writes <final>.<rank>)
        drop = {} if mode.startswith("diloco") else {"dropout": 0.3}
        return {"steps": 8, "every": 2, **drop, **kill, **files}
    # grow: a long enough run for a node to join and the policy to notice it
    return {"steps": 40 if mode == "grow" else 10, "every": 2,
            "step_sleep": 2.5 if mode == "grow" else 1.5, **files}


def main(mode: str, work: Path, storage_uri: str, endpoint: str) -> dict:
    ray.init(address="auto", log_to_driver=True)
    if mode == "storage":
        return storage_refused(work)
    if mode == "probe":
        return probe(storage_uri, endpoint)
    if mode == "diloco":  # one driver for both runs: a driver start less
        for run in ("diloco-ref", "diloco-kill"):
            res = fit(run, work, storage_uri, endpoint)
            if not res["ok"]:
                return {**res, "run": run}
        return res
    return fit(mode, work, storage_uri, endpoint)


def fit(mode: str, work: Path, storage_uri: str, endpoint: str) -> dict:
    spec = ray_mesh.MeshSpec.hsdp()
    diloco = mode.startswith("diloco")
    elastic = mode in ("elastic", "grow")
    workers: int | tuple[int, int] = (2, 4) if elastic else 4
    if isinstance(workers, tuple):
        check_elastic_mesh(spec, *workers)
    # The driver's check, as ray-mesh run makes it: endpoint, bucket, credentials, writes.
    check_storage(storage_uri, endpoint=endpoint, name=mode)
    train = (HERE / "_diloco_train.py" if diloco
             else HERE.parents[1] / "harness" / "ckpt_train.py")
    trainer = TorchTrainer(
        load_function(f"{train}:train_loop"),
        train_loop_config=_config(mode, work),
        scaling_config=ScalingConfig(num_workers=workers,
                                     resources_per_worker={"CPU": 0.5, "slot": 1},
                                     # grow: look for new nodes every 5 s
                                     elastic_resize_monitor_interval_s=5 if mode == "grow"
                                     else 3600),
        torch_config=ray_mesh.MeshConfig(mesh=spec, replicate=DILOCO if diloco else None),
        run_config=RunConfig(name=mode, **ray_mesh.run_storage(storage_uri, endpoint),
                             # elastic: the first restart may still count the dead node
                             failure_config=failure_config(
                                 2, startup_retries=3 if elastic else 1),
                             checkpoint_config=CheckpointConfig(
                                 num_to_keep=4 if diloco else 2)),
    )
    try:
        result = trainer.fit()
        return {"ok": result.error is None, "error": repr(result.error)}
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                "explained": explain_startup_failure(exc, workers),
                "trace": traceback.format_exc()[-3000:]}


if __name__ == "__main__":
    out = main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4])
    print("RESULT " + json.dumps(out), flush=True)
