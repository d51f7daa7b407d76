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
it.

The runs store to an S3 bucket: a real moto server process (``ray-mesh storage serve``)
inside the head's namespace, on its tailnet address, which the other node reaches through
the WireGuard tunnel; the nodes share no storage. (The step log and final parameters are
the test's own instrumentation, in pytest's ``tmp_path``.) The default-tier test, on the
dashboard cluster of tests/netns/conftest.py (whose nodes have the bucket's key; the slow
tier, which loses nodes, starts its own):
a worker SIGKILLed mid-run resumes from the bucket bitwise equal to an uninterrupted run (the
same training on 4 local ranks without Ray, beside it: tests/helpers/_ckpt_reference.py);
a shard object flipped in the bucket is refused by the manifest check on what comes back;
``ray-mesh status --storage s3://... --storage-endpoint ...`` reads the per-rank layout the
run wrote into the bucket. In the slow tier, besides the node kills: a DiLoCo run across
the nodes, killed, resumes its outer state from the bucket bitwise; the driver's storage
check refuses a loopback endpoint and names a node that cannot reach the bucket, for one
mesh and for a run of replica groups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_reference_run import reference_beside
from moto_s3 import KEY_NAMES, S3Server, new_credentials
from require_all import SLOW_ENV

from harness.ckpt_train import attempts, steps
from harness.netns import REPO, NetnsCluster, netns_unavailable_reason

pytestmark = [pytest.mark.ray, pytest.mark.netns]

DRIVER = Path(__file__).resolve().parents[1] / "helpers" / "_ckpt_elastic_driver.py"
STEPS = 10  # as in the driver



def _launch(cluster: NetnsCluster, mode: str, work: Path) -> subprocess.Popen:
    env = cluster.node_env(cluster.head)
    env.update(cluster.credentials, RAY_ADDRESS=cluster.address, PYTHONPATH=str(REPO),
               PYTHONUNBUFFERED="1",
               RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="20",
               # each checkpoint report, a start and a worker's death wait for the
               # controller's poll (2 s by default): as `ray-mesh run` sets it
               RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.2")
    out = open(work / f"{mode}.out", "w")  # noqa: SIM115 - closed with the process
    s3: S3Server = cluster.s3  # type: ignore[attr-defined]
    return subprocess.Popen([*cluster.head.exec_prefix(), sys.executable, str(DRIVER), mode,
                             str(work), s3.uri("runs"), s3.endpoint], env=env, stdout=out,
                            stderr=subprocess.STDOUT, text=True)


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


def _with_bucket(c: NetnsCluster):
    """The bucket's server in the head's namespace on its tailnet address, with the key every
    node of ``c`` got in its environment (``ray-mesh storage serve`` answers signed requests
    only; each real machine exports the key before Ray starts)."""
    c.credentials = {k: c.env[k] for k in (*KEY_NAMES, "AWS_EC2_METADATA_DISABLED")}
    c.s3 = S3Server(bucket="ckpt-netns", host=c.head.ip, prefix=c.head.exec_prefix(),
                    env=c.node_env(c.head), credentials=c.credentials)
    try:
        yield c
    finally:
        c.s3.stop()
        del c.s3, c.credentials


if os.environ.get(SLOW_ENV) == "1":
    @pytest.fixture(scope="module")
    def cluster():
        """Slow tier (its tests kill node 1 and add nodes): two nodes of its own (the
        head's dashboard on, for ``ray-mesh status``) and the bucket."""
        if reason := netns_unavailable_reason():
            pytest.skip(f"virtual cluster unavailable: {reason}")
        with NetnsCluster([{"slot": 2}, {"slot": 2}], env=new_credentials(), dashboard=True,
                          start_attempts=4, ray_start_timeout_s=180) as c:
            yield from _with_bucket(c)
else:
    @pytest.fixture(scope="module")
    def cluster(dashboard_cluster):
        """Default tier (no node lost): the 2 x {slot: 2} dashboard cluster of
        tests/netns/conftest.py, whose nodes have the bucket's key, and the bucket."""
        yield from _with_bucket(dashboard_cluster)


# Run in the head's namespace (the bucket's endpoint is on the tailnet): load checkpoint 8
# of the killed run (written after its restart) from the bucket (clean), flip one bit of a
# shard object of its checkpoint 6 in the bucket, and load that (refused).
_TAMPER = """
import copy, sys
import pyarrow.fs, torch
from ray_mesh.checkpointing import remote
from ray_mesh.core.object_store import filesystem
from ray_mesh.errors import CheckpointError

uri, endpoint = sys.argv[1], sys.argv[2]
fs, root = filesystem(uri, endpoint)
files = [i.path for i in fs.get_file_info(pyarrow.fs.FileSelector(root + "/kill",
                                                                 recursive=True))
         if i.type == pyarrow.fs.FileType.File]
def ckpt(step):
    (d,) = {p.rsplit("/", 1)[0] for p in files if f"/checkpoint_{step:08d}_" in p}
    return d
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                            torch.nn.Dropout(0.3), torch.nn.Linear(16, 6))
clean = remote.load("s3://" + ckpt(8), copy.deepcopy(model), endpoint=endpoint,
                    restore_rng=False)
print("CLEAN", clean.step)
shard = next(p for p in files if p.startswith(ckpt(6) + "/") and p.endswith("__1_0.distcp"))
with fs.open_input_stream(shard) as f:
    data = bytearray(f.read())
data[len(data) // 2] ^= 0x01
with fs.open_output_stream(shard) as f:
    f.write(bytes(data))
try:
    remote.load("s3://" + ckpt(6), copy.deepcopy(model), endpoint=endpoint)
    print("TAMPERED LOADED")
except CheckpointError as exc:
    print("REFUSED", exc)
"""


def _ref_and_kill(cluster: NetnsCluster, mode: str, work: Path, log: str,
                  timeout_s: float) -> tuple[list[str], list[str]]:
    """The driver's two runs (uninterrupted, then killed at step 5): the killed run's two
    attempts, as its log lines."""
    os.chmod(work, 0o777)  # the driver runs in the head's namespace
    t0 = time.monotonic()
    res = _result(_launch(cluster, mode, work), work, mode, timeout_s)
    assert res["ok"], res
    print(f"{mode} ref + kill: {time.monotonic() - t0:.0f} s")
    first, second = attempts(work / log)
    return first, second


@pytest.mark.timeout(600)
def test_bucket_resume_is_bitwise_tampering_refused_and_status_reads_it(cluster, tmp_path):
    """Default tier: no node is lost, so the slow tests below still find both nodes.

    The uninterrupted reference is the same training (model, seed, dropout, batches, the
    2 x 2 HSDP mesh, gloo) on 4 ranks forked on this host, no Ray: bitwise what an
    uninterrupted run under Ray Train ends with (it replaced one, whose bring-up of 4 workers
    cost ~25 s; its ~7 s run beside the killed one's start)."""
    os.chmod(tmp_path, 0o777)  # the driver runs in the head's namespace
    with reference_beside(tmp_path / "ref.pt", tmp_path):
        res = _result(_launch(cluster, "kill", tmp_path), tmp_path, "kill", 400)
        assert res["ok"], res
    first, second = attempts(tmp_path / "kill.log")
    assert steps(first) == [1, 2, 3, 4], first
    assert second[0].startswith("start 4 checkpoint_00000004_"), second  # from the bucket
    assert steps(second) == [5, 6, 7, 8], second
    a, b = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "kill.pt")
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from the uninterrupted run"

    s3 = cluster.s3
    script = tmp_path / "tamper.py"
    script.write_text(_TAMPER)
    out = cluster.run_in(0, [sys.executable, str(script), s3.uri("runs"), s3.endpoint],
                         timeout=120, env={**cluster.credentials, "PYTHONPATH": str(REPO)})
    text = out.stdout + out.stderr
    assert "CLEAN 8" in text, text[-3000:]
    refused = [x for x in text.splitlines() if x.startswith("REFUSED ")]
    assert refused and "__1_0.distcp is corrupt: its SHA-256 differs" in refused[0], text

    out = cluster.run_in(0, [sys.executable, "-m", "ray_mesh.cli.main", "status", "--all",
                             "--address", f"http://{cluster.head.ip}:8265",
                             "--storage", s3.uri("runs"), "--storage-endpoint", s3.endpoint,
                             "--deadline", "60", "--timeout", "15"],
                         timeout=120, env={**cluster.credentials, "PYTHONPATH": str(REPO)})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "(layout from run dir)" in text, text[-4000:]
    assert cluster.nodes[1].ip in text, text[-4000:]  # ranks on the far node, from the bucket


# Slow tier (~100 s: a reference run, a killed run and its restart): the DiLoCo outer state's
# resume from a bucket, bitwise, runs on local Ray in
# tests/ray/test_checkpoint_s3_ray.py::test_diloco_outer_state_resumes_from_the_bucket (~45 s),
# a resume from the bucket across this cluster's tunnel in the test above, the loopback and
# unanswered endpoints' messages in tests/unit/test_storage_s3.py, and the per-node storage
# probe naming a node in tests/netns/test_private_files.py.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_diloco_resumes_from_the_bucket_and_a_node_cut_off_from_it_is_named(cluster, tmp_path):
    """No node lost. DiLoCo with its replicas on the two nodes (FSDP inside
    each), rank 1 killed at step 5: the restart takes checkpoint 4 from the bucket (after
    the outer step at 3, between syncs) and both replicas end bitwise equal to an
    uninterrupted run's. Then the driver's storage check on the two-node cluster: an
    endpoint on loopback is refused by name; with node 1's packets to the bucket dropped
    (a firewall on that box), node 1's own probe fails and the error names node 1."""
    first, second = _ref_and_kill(cluster, "diloco", tmp_path, "diloco-kill.log", 500)
    assert steps(first)[:4] == [1, 2, 3, 4], first  # rank 0 may log step 5 before it stops
    assert second[0].startswith("start 4 checkpoint_00000004_"), second  # from the bucket
    assert "replicas=2 inner=4 outer=1" in second[0], second[0]
    assert steps(second) == [5, 6, 7, 8], second
    assert any("sync equal=True" in x for x in second), second  # the outer step at 6
    for rank in range(4):
        a = torch.load(tmp_path / f"diloco-ref.pt.{rank}")
        b = torch.load(tmp_path / f"diloco-kill.pt.{rank}")
        for k in a:
            assert torch.equal(a[k], b[k]), f"rank {rank} {k} differs from the uninterrupted run"

    s3, far = cluster.s3, cluster.nodes[1]
    rule = ["OUTPUT", "-p", "tcp", "-d", cluster.head.ip, "--dport", str(s3.port), "-j", "DROP"]
    cluster.run_in(1, ["iptables", "-I", *rule], check=True)
    try:
        res = _result(_launch(cluster, "probe", tmp_path), tmp_path, "probe", 200)
    finally:
        cluster.run_in(1, ["iptables", "-D", *rule], check=True)
    assert res["loopback"] and "is on loopback, which is each machine's own" in res["loopback"]
    assert "--host $(tailscale ip -4)" in res["loopback"], res
    assert res["node"] and res["node"].startswith(f"on node {far.ip}: storage endpoint "
                                                  f"{s3.endpoint} did not answer within 5 s"), res
    assert "\n" not in res["node"] and "credentials its `ray start` ran with" in res["node"]
    # a run of replica groups on that storage (its fallback checkpoints go there) is refused
    # the same way on the driver, naming the node, before any group starts
    assert res["groups"] and res["groups"].startswith(f"on node {far.ip}: storage endpoint "
                                                      f"{s3.endpoint} did not answer within"), res


# Slow tier (~2 min: a node killed mid-run, a restart, a reshard): elastic resharding is
# unit-tested in tests/unit/test_checkpoint_elastic.py, kill/resume under Ray in
# tests/ray/test_checkpoint_ray.py.
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_storage_refused_and_elastic_shrink(cluster, tmp_path):
    os.chmod(tmp_path, 0o777)  # the driver runs in the head's namespace
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
