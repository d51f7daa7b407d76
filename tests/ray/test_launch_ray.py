"""``ray-mesh run`` through the launch layer, with Ray: the job file parsed once and the
storage probed once per place, for one mesh and for replica groups.

The whole command runs in this process (``ray_mesh.cli.main.main``, joining the session's
Ray) with the parser and the driver's storage probes counted (wrapped, not replaced: the
real probes run against a moto server, the real run trains). Before the launch layer, the
one-mesh path parsed the job three times (``from_yaml``, ``with_num_workers``,
``with_storage``) and the driver probed the bucket twice (``check_before_ray``, then
``check_cluster(check_store=True)``); the groups' path probed it twice as well
(``check_before_ray``, then ``fit_replica_groups``' own check).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from moto_s3 import S3Server

import ray_mesh.checkpointing.storage as storage_mod
from ray_mesh.cli.job import Job
from ray_mesh.cli.main import PROGRESS_LINES, main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray

TRAIN = """\
import ray.train

import ray_mesh


def f(config):
    ray_mesh.get_mesh()
    for step in range(1, config["steps"] + 1):
        ray.train.report({"step": step, "loss": 1.0 / step})
"""


@pytest.fixture
def counted(monkeypatch) -> dict[str, list]:
    """Calls of the job parser, the driver's bucket probe, and the rounds of node probes."""
    calls: dict[str, list] = {"parse": [], "driver": [], "nodes": []}
    real_parse = Job.from_dict.__func__

    def parse(cls, data, base_dir=None):
        calls["parse"].append(1)
        return real_parse(cls, data, base_dir)

    real_probe, real_nodes = storage_mod.check_object_storage, storage_mod._check_nodes_uri

    def probe(path, endpoint=None, **kw):
        calls["driver"].append(path)
        return real_probe(path, endpoint, **kw)

    def nodes(path, endpoint, timeout_s, alive):
        calls["nodes"].append(path)
        return real_nodes(path, endpoint, timeout_s, alive)

    monkeypatch.setattr(Job, "from_dict", classmethod(parse))
    monkeypatch.setattr(storage_mod, "check_object_storage", probe)
    monkeypatch.setattr(storage_mod, "_check_nodes_uri", nodes)
    monkeypatch.setenv("RAY_DEDUP_LOGS_ALLOW_REGEX", PROGRESS_LINES)  # main sets it
    return calls


@pytest.fixture
def s3():
    # The session's Ray has these credentials in its environment (tests/conftest.py).
    server = S3Server(bucket="launch-ray", credentials={
        k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    yield server
    server.stop()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("shape", ["one mesh", "replica groups"])
def test_ray_mesh_run_parses_once_and_probes_the_storage_once(ray_local, tmp_path, s3, counted,
                                                              shape, capsys):
    (tmp_path / "t.py").write_text(TRAIN)
    if shape == "one mesh":
        job = "train: t.py:f\nconfig: {steps: 3}\nmesh: ddp\nscaling: {num_workers: 4}\n"
        flags = ["--num-workers", "2"]
    else:
        job = (f"train: {ROOT / 'harness' / 'replica_train.py'}:train_loop\n"
               "replica_groups: {groups: 1, workers_per_group: 1, steps: 3, "
               "segment_samples: 2, checkpoint_every: 2}\n"
               "scaling: {resources_per_worker: {CPU: 1}}\n")
        flags = []
    (tmp_path / "job.yaml").write_text(job)
    gcs = ray_local.get_runtime_context().gcs_address
    code = main(["run", "--address", gcs, str(tmp_path / "job.yaml"), *flags,
                 "--storage-path", s3.uri("runs"), "--storage-endpoint", s3.endpoint])
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    assert "finished" in out.out, out.out[-3000:]
    assert len(counted["parse"]) == 1, counted  # was 3 on the one-mesh path
    assert counted["driver"] == [s3.uri("runs")], counted  # was 2: before Ray and with it
    assert counted["nodes"] == [s3.uri("runs")], counted  # every node, once
