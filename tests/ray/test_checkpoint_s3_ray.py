"""Checkpoints in an S3 bucket through Ray Train: kill and resume, tampering, DiLoCo, status.

Real parts only: a moto S3 server process (``ray-mesh storage serve``, module fixture), the
shared local Ray (``ray_local``), CPU workers with gloo, FSDP2. The runs get their storage
the way a Ray user writes it: ``RunConfig(name=..., **ray_mesh.run_storage("s3://bucket/runs",
endpoint))`` -- an ``S3FileSystem`` at the endpoint, credentials from the environment.

1. (slow tier) HSDP 2x2 to the bucket, uninterrupted, then the same with rank 1 SIGKILLed at
   step 8: Ray restarts the group, which downloads checkpoint 6 from the bucket, checks it
   against its manifest and resumes; the final parameters are bitwise equal to the
   uninterrupted run's. Then one object of a checkpoint in the bucket is tampered with (one
   bit, same length): loading it from the bucket is refused with a CheckpointError naming
   the shard. And ``ray-mesh status --storage s3://... --storage-endpoint ...`` reads the
   per-rank layout the run wrote into the bucket.
2. DiLoCo over 2 replicas to the bucket: killed at step 5, the restart resumes the outer
   state (outer step, outer momentum) and each replica's state from the bucket, bitwise
   equal to the same training uninterrupted (2 ranks forked on this host, without Ray:
   tests/helpers/_ckpt_reference.py).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pyarrow.fs
import pytest
import torch
from ckpt_reference_run import reference_beside
from moto_s3 import S3Server

from harness.ckpt_train import attempts, steps
from ray_mesh.checkpointing import sharded
from ray_mesh.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]
HSDP_TRAIN = str(REPO / "harness" / "ckpt_train.py") + ":train_loop"
DILOCO_TRAIN = str(REPO / "tests" / "helpers" / "_diloco_train.py") + ":train_loop"


@pytest.fixture(scope="module")
def s3(ray_local):
    # The server answers requests signed with its key only: it gets the credentials the
    # local Ray's workers inherited (set by ray_local, tests/conftest.py), as a lab's nodes
    # have the server's key in their environment.
    server = S3Server(bucket="ckpt-bucket", credentials={
        k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    yield server
    server.stop()


def _fit(s3: S3Server, train: str, name: str, config: dict, mesh_config, workers: int,
         max_failures: int = 0, num_to_keep: int = 3):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh
    from ray_mesh.cli.job import load_function

    # The driver's check, as ray-mesh run makes it: endpoint, bucket, credentials, writes.
    ray_mesh.check_storage(s3.uri("runs"), endpoint=s3.endpoint, name=name)
    trainer = TorchTrainer(
        load_function(train), train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        torch_config=mesh_config,
        run_config=RunConfig(name=name, **ray_mesh.run_storage(s3.uri("runs"), s3.endpoint),
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep)))
    t0 = time.monotonic()
    result = trainer.fit()
    print(f"fit {name}: {time.monotonic() - t0:.1f} s")
    return result


def _objects(s3: S3Server, prefix: str) -> dict[str, int]:
    fs = s3.filesystem()
    sel = pyarrow.fs.FileSelector(f"{s3.bucket}/{prefix}", recursive=True,
                                  allow_not_found=True)
    return {i.path: i.size for i in fs.get_file_info(sel)
            if i.type == pyarrow.fs.FileType.File}


def _checkpoints(s3: S3Server, run: str) -> dict[int, str]:
    dirs = {p.rsplit("/", 2)[-2] for p in _objects(s3, f"runs/{run}") if "/checkpoint_" in p}
    return {sharded.step_of(d): f"s3://{s3.bucket}/runs/{run}/{d}" for d in dirs
            if sharded.step_of(d) is not None}


# Slow tier (~65 s): the same scenario runs in the default tier where users have it, on the
# WireGuard cluster with no shared filesystem and the bucket on the head
# (tests/netns/test_checkpoint_netns.py::test_bucket_resume_is_bitwise_tampering_refused_...).
@pytest.mark.slow
@pytest.mark.ray
def test_hsdp_in_a_bucket_resumes_bitwise_refuses_tampering_and_status_reads_it(
        ray_local, s3, tmp_path, monkeypatch):
    import ray_mesh
    from ray_mesh.checkpointing import remote

    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    mesh = ray_mesh.MeshConfig(mesh={"dp_replicate": 2, "dp_shard": 2}, measure_links=False)
    base = {"steps": 12, "every": 3, "dropout": 0.3}

    # 1. uninterrupted reference, checkpoints in the bucket
    ref = _fit(s3, HSDP_TRAIN, "reference", {**base, "log": str(tmp_path / "ref.log"),
                                             "final": str(tmp_path / "ref.pt")}, mesh, 4)
    assert ref.error is None
    (run,) = attempts(tmp_path / "ref.log")
    assert steps(run) == list(range(1, 13))
    kept = _checkpoints(s3, "reference")
    assert sorted(kept) == [6, 9, 12], kept  # num_to_keep=3: Ray rotated the older out
    assert ref.checkpoint is not None and ref.checkpoint.path.startswith(f"{s3.bucket}/runs/")
    # every rank's shards were merged into one directory in the bucket, manifest and marker
    names = {p.rsplit("/", 1)[-1] for p in _objects(s3, "runs/reference")
             if "checkpoint_00000012" in p}
    assert {sharded.MARKER, sharded.MANIFEST, ".metadata"} <= names
    assert len([n for n in names if n.endswith(".distcp")]) == 4, names

    # 2. rank 1 is SIGKILLed at step 8: the restart downloads checkpoint 6 from the bucket
    log = tmp_path / "kill.log"
    res = _fit(s3, HSDP_TRAIN, "killed", {**base, "kill_at": 8, "log": str(log),
                                          "kill_marker": str(tmp_path / "killed"),
                                          "final": str(tmp_path / "kill.pt")},
               mesh, 4, max_failures=1)
    assert res.error is None
    first, second = attempts(log)
    assert steps(first) == list(range(1, 8)), first
    assert second[0].startswith("start 6 checkpoint_00000006_"), second
    assert steps(second) == list(range(7, 13)), second
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "kill.pt")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"

    # 3. what comes back from the bucket is checked against the manifest: a clean checkpoint
    # loads; one bit flipped in a shard object (same length) is refused, naming the shard.
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(16, 6))
    progress = remote.load(kept[12], copy.deepcopy(model), endpoint=s3.endpoint,
                           restore_rng=False)
    assert progress.step == 12 and progress.path == kept[12]
    fs = s3.filesystem()
    shard = next(p for p in _objects(s3, "runs/reference")
                 if "checkpoint_00000009" in p and p.endswith("__1_0.distcp"))
    with fs.open_input_stream(shard) as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0x01
    with fs.open_output_stream(shard) as f:
        f.write(bytes(data))
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is corrupt: its SHA-256 "
                                              r"differs") as err:
        remote.load(kept[9], copy.deepcopy(model), endpoint=s3.endpoint)
    assert kept[9] in str(err.value) and "\n" not in str(err.value)

    # 4. ray-mesh status reads the per-rank layout the run wrote into the bucket -- only when
    # the viewer names that storage. The Train state comes from a stand-in dashboard holding
    # what Ray records for such a run (the path inside the S3 filesystem, and its type).
    from hostile_dashboard import Dashboard, train_run, worker

    from ray_mesh.status import cluster as st

    layout = json.loads(fs.open_input_stream(
        f"{s3.bucket}/runs/reference/ray_mesh_layout.json").read())
    assert [r["rank"] for r in layout["ranks"]] == [0, 1, 2, 3]
    state = train_run("reference", workers=[worker(r) for r in range(4)],
                      storage=f"{s3.bucket}/runs")
    state["run_settings"]["run_config"]["storage_filesystem"] = (
        "<pyarrow._s3fs.S3FileSystem object at 0x7f00>")
    state["run_settings"]["backend_config"]["config"]["mesh"] = {"dp_replicate": 2,
                                                                 "dp_shard": 2}
    dash = Dashboard()
    try:
        dash.serve(runs=[state])
        unnamed = st.format_status(st.collect(dash.url, timeout_s=5))
        assert "(layout from train state)" in unnamed and "--storage s3://" in unnamed
        named = st.format_status(st.collect(dash.url, timeout_s=10,
                                            storage=[s3.uri("runs")],
                                            storage_endpoint=s3.endpoint))
    finally:
        dash.close()
    assert "(layout from run dir)" in named, named
    iface = layout["ranks"][0]["interface"]
    assert iface in named, named


# Default tier (~45 s): the same scenario across two nodes of the WireGuard cluster, with the
# bucket on the head, is the slow tier's
# (tests/netns/test_checkpoint_netns.py::test_diloco_resumes_from_the_bucket_and_...): the
# bucket across the tunnel is the default tier's there, with HSDP.
@pytest.mark.ray
def test_diloco_outer_state_resumes_from_the_bucket(ray_local, s3, tmp_path, monkeypatch):
    import ray_mesh

    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    replicate = {"mode": "diloco", "every": 3, "outer_lr": 0.7, "outer_momentum": 0.9}
    mesh = ray_mesh.MeshConfig(mesh={"dp_replicate": 2, "dp_shard": 1}, replicate=replicate,
                               measure_links=False)
    base = {"steps": 8, "every": 2}
    # The uninterrupted reference: the same training on 2 ranks forked on this host, no Ray
    # (tests/helpers/_ckpt_reference.py: bitwise what an uninterrupted fit ends with, which
    # it replaced, ~15 s of Ray Train bring-up), beside the killed run's start.
    log = tmp_path / "kill.log"
    with reference_beside(tmp_path / "ref", tmp_path, mode="diloco"):
        res = _fit(s3, DILOCO_TRAIN, "diloco-killed",
                   {**base, "kill_at": 5, "kill_marker": str(tmp_path / "killed"),
                    "log": str(log), "final": str(tmp_path / "kill")}, mesh, 2,
                   max_failures=1, num_to_keep=4)
    assert res.error is None
    first, second = attempts(log)
    # checkpoint 4 (after the outer step at 3, between syncs) came back from the bucket
    assert second[0].startswith("start 4 checkpoint_00000004_"), second[0]
    assert "inner=4 outer=1" in second[0], second[0]
    assert steps(second) == list(range(5, 9)), second
    for rank in range(2):
        a, b = torch.load(tmp_path / f"ref.{rank}"), torch.load(tmp_path / f"kill.{rank}")
        for k in a:
            assert torch.equal(a[k], b[k]), f"rank {rank} {k} differs from the uninterrupted run"
    assert _checkpoints(s3, "diloco-killed"), "no checkpoint in the bucket"
