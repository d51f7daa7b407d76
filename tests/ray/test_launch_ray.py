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
import signal
from pathlib import Path

import pytest
from moto_s3 import S3Server

import ray_mesh.checkpointing.storage as storage_mod
from ray_mesh.cli.job import Job
from ray_mesh.cli.main import PROGRESS_LINES, main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray

TRAIN = """\
import os
import signal
import subprocess

import ray.train

import ray_mesh


def hold_log_monitor(seconds):
    # Stop this node's Ray log monitor for a while: a starved node's late log stream.
    logs = os.path.dirname(os.readlink("/proc/self/fd/2")).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        except OSError:
            continue
        if any(a.endswith(b"log_monitor.py") for a in args) and b"--logs-dir=" + logs in args:
            # Not a child of this worker: Ray kills a worker's children when it exits.
            subprocess.run(["sh", "-c", f"(sleep {seconds}; kill -CONT {pid}) >/dev/null 2>&1 &"],
                           start_new_session=True, check=True)
            os.kill(int(pid), signal.SIGSTOP)
            return
    raise RuntimeError(f"no log monitor writes {logs}")


def f(config):
    ray_mesh.get_mesh()
    for step in range(1, config["steps"] + 1):
        if step == config["steps"] and ray.train.get_context().get_world_rank() == 0:
            hold_log_monitor(config.get("hold_s", 0))
        ray_mesh.report({"step": step, "loss": 1.0 / step})
"""
HOLD_S = 3  # the log monitor's pause at the last report (one mesh)


def resume_log_monitors() -> None:
    """SIGCONT every stopped Ray log monitor on this machine (state ``T``)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"log_monitor.py" in args and state == "T":
            os.kill(int(pid), signal.SIGCONT)


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
        job = (f"train: t.py:f\nconfig: {{steps: 3, hold_s: {HOLD_S}}}\nmesh: ddp\n"
               "scaling: {num_workers: 4}\n")
        flags = ["--num-workers", "2"]
    else:
        job = (f"train: {ROOT / 'harness' / 'replica_train.py'}:train_loop\n"
               "replica_groups: {groups: 1, workers_per_group: 1, steps: 3, "
               "segment_samples: 2, checkpoint_every: 2}\n"
               "scaling: {resources_per_worker: {CPU: 1}}\n")
        flags = []
    (tmp_path / "job.yaml").write_text(job)
    gcs = ray_local.get_runtime_context().gcs_address
    try:
        code = main(["run", "--address", gcs, str(tmp_path / "job.yaml"), *flags,
                     "--storage-path", s3.uri("runs"), "--storage-endpoint", s3.endpoint])
    finally:
        resume_log_monitors()  # whatever happened to the worker's timer
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]
    assert "finished" in out.out, out.out[-3000:]
    if shape == "one mesh":
        # The last progress line came out before main() returned, though the node's log
        # monitor held it back HOLD_S seconds after fit() ended (console_tail): without the
        # wait it showed after the summary, or (an embedded Ray) never.
        assert "t: step 3/3 " in out.err + out.out, (out.err + out.out)[-3000:]
        assert "had not reached" not in out.out, out.out[-3000:]
    assert len(counted["parse"]) == 1, counted  # was 3 on the one-mesh path
    assert counted["driver"] == [s3.uri("runs")], counted  # was 2: before Ray and with it
    assert counted["nodes"] == [s3.uri("runs")], counted  # every node, once
