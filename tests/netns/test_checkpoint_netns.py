"""Elastic restart and its refusal on a virtual multi-node cluster (network namespaces).

Two namespace nodes with 2 worker slots each, HSDP mesh ``MeshSpec.hsdp()`` (dp_replicate
follows the nodes), checkpoints every 2 steps. A node is killed (every process in its
namespace: a crashed machine) while the run trains:

* elastic run, ``num_workers=(2, 4)``: Ray Train restarts on the 2 workers left; the mesh is
  rebuilt with dp_replicate 2 -> 1 and dp_shard kept at 2, and training resumes from the
  last checkpoint, resharded, with no gap in the steps.
* fixed run, ``num_workers=4`` (after a replacement node joined): the restart cannot place 4
  workers; with bounded start-up retries it stops with an error saying the run is not
  elastic and what to change, instead of retrying forever.

Last, an elastic run started on the one node left grows to two nodes (dp_replicate 1 -> 2)
when a node joins, through Ray's elastic resize, from its last checkpoint.

Before that, a storage_path on the head's own disk (each virtual node has a private
``/tmp/ray-mesh-node``) is refused at start as node-local, naming the node that cannot see
it. The runs themselves store to pytest's ``tmp_path``, which every node sees: a stand-in
for a shared filesystem until S3 storage (moto) is in the harness.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.ckpt_train import attempts, steps
from harness.netns_cluster import REPO, NetnsCluster, netns_unavailable_reason

pytestmark = [pytest.mark.ray, pytest.mark.netns]

DRIVER = Path(__file__).resolve().parents[1] / "helpers" / "_ckpt_elastic_driver.py"
STEPS = 10  # as in the driver



def _launch(cluster: NetnsCluster, mode: str, work: Path) -> subprocess.Popen:
    env = cluster.node_env(cluster.head)
    env.update(RAY_ADDRESS=cluster.address, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1",
               RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="20",
               RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.5")
    out = open(work / f"{mode}.out", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([*cluster.head.exec_prefix(), sys.executable, str(DRIVER), mode,
                             str(work)], env=env, stdout=out, stderr=subprocess.STDOUT,
                            text=True)


def _kill_after_checkpoint(cluster: NetnsCluster, proc: subprocess.Popen, log: Path,
                           node: int, timeout_s: float = 400) -> None:
    """Kill ``node`` once the run has reported a checkpoint past step 2."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"driver exited early: {log.with_suffix('.out').read_text()[-3000:]}")
        if log.exists() and any(" ckpt " in x and int(x.split()[3]) >= 4
                                for x in log.read_text().splitlines()):
            cluster.kill_node(node)
            return
        time.sleep(0.5)
    proc.kill()
    tail = log.with_suffix(".out").read_text()[-3000:]
    pytest.fail(f"no checkpoint within {timeout_s} s: {tail}")


def _result(proc: subprocess.Popen, work: Path, mode: str, timeout_s: float = 500) -> dict:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"{mode} driver ran past {timeout_s} s: "
                    f"{(work / f'{mode}.out').read_text()[-3000:]}")
    text = (work / f"{mode}.out").read_text()
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    assert lines, text[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if reason := netns_unavailable_reason():
        pytest.skip(f"virtual cluster unavailable: {reason}")
    with NetnsCluster([{"slot": 2}, {"slot": 2}]) as c:
        yield c


# Slow tier (~2 min: a node killed mid-run, a restart, a reshard): elastic resharding is
# unit-tested in tests/unit/test_checkpoint_elastic.py, kill/resume under Ray in
# tests/ray/test_checkpoint_ray.py.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_storage_refused_and_elastic_shrink(cluster, tmp_path):
    os.chmod(tmp_path, 0o777)
    # --- storage: a path only the head has (its private disk) is refused before training
    res = _result(_launch(cluster, "storage", tmp_path), tmp_path, "storage", 200)
    assert not res["ok"], res
    assert "is local to each node" in res["error"], res
    assert f"not visible on nodes ['{cluster.nodes[1].ip}']" in res["error"], res

    # --- elastic: lose node 1 mid-run, continue on node 0 with dp_replicate=1
    t0 = time.monotonic()
    proc = _launch(cluster, "elastic", tmp_path)
    _kill_after_checkpoint(cluster, proc, tmp_path / "elastic.log", node=1)
    res = _result(proc, tmp_path, "elastic")
    print(f"elastic phase: {time.monotonic() - t0:.0f} s")
    assert res["ok"], res
    runs = attempts(tmp_path / "elastic.log")
    print(runs)
    assert runs[0][0].startswith("start 0 - mesh=2x2"), runs[0]
    last = max(int(x.split()[3]) for x in runs[0] if " ckpt " in x)
    resumed = runs[-1]
    assert resumed[0].startswith(f"start {last} checkpoint_{last:08d}_"), resumed
    assert " mesh=1x2 " in resumed[0], resumed  # dp_replicate shrank, dp_shard kept
    assert steps(resumed) == list(range(last + 1, STEPS + 1)), resumed


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fixed_run_losing_a_node_is_refused(cluster, tmp_path):
    """Runs after the elastic test: node 1 is dead, a replacement joins first."""
    os.chmod(tmp_path, 0o777)
    t1 = time.monotonic()
    node = cluster.add_node({"slot": 2}).index
    proc = _launch(cluster, "fixed", tmp_path)
    _kill_after_checkpoint(cluster, proc, tmp_path / "fixed.log", node=node)
    res = _result(proc, tmp_path, "fixed")
    print(f"fixed phase: {time.monotonic() - t1:.0f} s")
    assert not res["ok"], res
    assert res["explained"], res
    assert "not elastic" in res["explained"] and "fixed 4 workers" in res["explained"], res


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_elastic_run_grows_when_a_node_joins(cluster, tmp_path):
    """Runs last: one node (0) is alive. An elastic run starts on it, a node joins, Ray's
    elastic policy restarts the group on both nodes, the mesh grows to dp_replicate=2."""
    os.chmod(tmp_path, 0o777)
    t0 = time.monotonic()
    proc = _launch(cluster, "grow", tmp_path)
    log = tmp_path / "grow.log"
    deadline = time.monotonic() + 400
    while not (log.exists() and " ckpt " in log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail((tmp_path / "grow.out").read_text()[-3000:])
        time.sleep(0.5)
    cluster.add_node({"slot": 2})
    res = _result(proc, tmp_path, "grow")
    print(f"grow phase: {time.monotonic() - t0:.0f} s")
    assert res["ok"], res
    runs = attempts(log)
    print(runs)
    assert runs[0][0].startswith("start 0 - mesh=1x2"), runs[0]
    grown = runs[-1]
    assert " mesh=2x2 " in grown[0], runs  # dp_replicate followed the new node
    # Resumed from the newest checkpoint of the attempt before (its log line may be lost
    # if the resize stopped the worker right after Ray registered it).
    start = int(grown[0].split()[1])
    before = runs[-2]
    last_logged = max([0] + [int(x.split()[3]) for x in before if " ckpt " in x])
    assert start % 2 == 0 and last_logged <= start <= steps(before)[-1], runs
    assert steps(grown) == list(range(start + 1, 41)), grown
