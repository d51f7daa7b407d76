"""Object storage refused on the driver in one line, against real S3 server processes.

Each bad input a user can give for checkpoints in a bucket -- a malformed URI or endpoint,
an endpoint where nothing listens or that does not answer, a bucket that does not exist,
credentials the server does not know, a secret that does not match, a key that may only
read, a server that stores other bytes than it was sent -- is refused by
``check_storage`` (what ``ray-mesh run`` and ``check_cluster`` call before any worker
starts) with one :class:`~ray_mesh.errors.RayMeshError` line naming the fix. The servers are
real processes: ``ray-mesh storage serve`` (moto) and a ``moto_server`` that enforces
credentials (``tests/helpers/moto_s3.py``). A good bucket is accepted and the probe leaves
every object that was there untouched, and nothing of its own. (What ``ray-mesh storage
serve`` refuses, unsigned and foreign requests: ``test_storage_serve_auth.py``.)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from moto_s3 import FAKE_CREDENTIALS, AuthS3Server, BareS3Server, S3Server
from ports import free_port

from ray_mesh.checkpointing import check_storage
from ray_mesh.cli.job import Job, JobError
from ray_mesh.errors import ObjectStoreError, StorageURIError

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "harness" / "ckpt_train.py") + ":train_loop"


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def creds(monkeypatch):
    """Some credentials, for checks that never reach a server."""
    for k, v in FAKE_CREDENTIALS.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def signed(s3, monkeypatch):
    """The key of the ``s3`` server (made at its start), as a node exports it."""
    for k, v in s3.credentials.items():
        monkeypatch.setenv(k, v)


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < 600, text
    return text


# ----------------------------------------------------------------------------- text
@pytest.mark.parametrize("path, endpoint, expect", [
    ("s3://", None, "names no bucket"),
    ("s3://Bad_Bucket/runs", None, "not valid: 3-63 characters"),
    ("s3://ab/runs", None, "not valid: 3-63 characters"),
    ("s3:/bucket/runs", None, "is not a URI"),
    ("s3://bucket/runs?endpoint=http://x", None, "unknown URI options"),
    ("s3://bucket/runs", "localhost:9000", "must start with http:// or https://"),
    ("s3://bucket/runs", "http://host:99999", "is not a server URL"),
    ("s3://bucket/runs", "http://host:9000/bucket", "is not a server URL"),
    ("/tmp/results", "http://host:9000", "is a local path"),
    ("gs://bucket/runs", "http://host:9000", "is for s3:// storage"),
    ("s3://bucket/runs?endpoint_override=h:1&scheme=http", "http://host:9000", "keep one"),
])
def test_a_malformed_location_is_refused_before_anything_is_contacted(path, endpoint, expect):
    t0 = time.monotonic()
    with pytest.raises(StorageURIError, match=expect) as err:
        check_storage(path, endpoint=endpoint)
    assert time.monotonic() - t0 < 1.0  # the text alone: no connection was tried
    _one_line(err.value)
    # the job file says the same, naming the key
    run = {"storage_path": path, **({"storage_endpoint": endpoint} if endpoint else {})}
    with pytest.raises(JobError, match=r"^run\.storage_"):
        Job.from_dict({"train": TRAIN, "run": run})


def test_an_endpoint_without_a_path_is_refused_in_the_job():
    with pytest.raises(JobError, match="storage_path is not"):
        Job.from_dict({"train": TRAIN, "run": {"storage_endpoint": "http://h:9000"}})


@pytest.mark.parametrize(("path", "endpoint"), [
    ("s3://bucket/runs", "http://127.0.0.1:9000"),
    ("s3://bucket/runs", "http://localhost:9000"),
    ("s3://bucket/runs", "http://[::1]:9000"),
    ("s3://bucket/runs?endpoint_override=127.0.0.2:9000&scheme=http", None),
])
def test_a_loopback_endpoint_is_refused_on_a_cluster_of_several_nodes(path, endpoint):
    """What the driver checks once Ray says the cluster has several nodes (end to end on two
    nodes: tests/netns/test_checkpoint_netns.py); one node may use loopback."""
    from ray_mesh.checkpointing.storage import refuse_loopback

    refuse_loopback(path, endpoint, 1)
    with pytest.raises(ObjectStoreError, match="is on loopback, which is each machine's own: "
                                               "the 2 other node") as err:
        refuse_loopback(path, endpoint, 3)
    assert "ray-mesh storage serve --host" in str(err.value)
    _one_line(err.value)
    refuse_loopback("s3://bucket/runs", "http://100.64.0.1:9000", 3)  # a tailnet address
    refuse_loopback("s3://bucket/runs", None, 3)  # AWS itself


# ----------------------------------------------------------------------------- server
def test_a_good_bucket_is_accepted_and_the_probe_touches_nothing_else(s3, signed):
    fs = s3.filesystem()
    old = f"{s3.bucket}/runs/exp/checkpoint_00000003_abc/__0_0.distcp"
    with fs.open_output_stream(old) as f:
        f.write(b"weights that must survive")
    import pyarrow.fs

    def listing():
        sel = pyarrow.fs.FileSelector(s3.bucket, recursive=True)
        return sorted((i.path, i.size) for i in fs.get_file_info(sel))

    before = listing()
    assert check_storage(s3.uri("runs"), endpoint=s3.endpoint) == s3.uri("runs")
    assert listing() == before
    with fs.open_input_stream(old) as f:
        assert f.read() == b"weights that must survive"
    # pyarrow's own URI form works too
    check_storage(f"{s3.uri('runs')}?endpoint_override=127.0.0.1:{s3.port}&scheme=http")


def test_a_missing_bucket_is_named_with_how_to_create_it(s3, signed):
    with pytest.raises(ObjectStoreError, match="bucket 'no-such-bucket' does not exist. "
                                               "Create it") as err:
        check_storage("s3://no-such-bucket/runs", endpoint=s3.endpoint)
    assert s3.endpoint in _one_line(err.value)


def test_an_endpoint_where_nothing_listens_is_refused_at_once(creds):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(ObjectStoreError, match="refused the connection") as err:
        check_storage("s3://bucket/runs", endpoint=f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5
    assert "ray-mesh storage serve" in _one_line(err.value)


def test_an_endpoint_that_does_not_answer_is_a_bounded_wait(creds):
    """A listener whose accept queue is full drops new SYNs: a connect hangs, as to a host
    behind a firewall that drops packets. The check gives up at its bound."""
    import socket

    with socket.socket() as srv, socket.socket() as filler:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        filler.connect(("127.0.0.1", port))  # fills the queue; never accepted
        t0 = time.monotonic()
        with pytest.raises(ObjectStoreError, match=f"storage endpoint http://127.0.0.1:{port} "
                                                   f"did not answer within 2 s") as err:
            check_storage("s3://bucket/runs", endpoint=f"http://127.0.0.1:{port}",
                          timeout_s=2)
        assert time.monotonic() - t0 < 10
    assert "Fix storage_endpoint" in _one_line(err.value)


def _no_credentials(monkeypatch, home: Path) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
              "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(home))  # no ~/.aws
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_a_server_that_keeps_other_bytes_is_caught_by_the_read_back(monkeypatch, tmp_path):
    """No credentials: pyarrow's SDK uploads anonymously with aws-chunked framing, which a
    bare moto stores as is; checkpoints would be corrupt. The probe reads back and says so."""
    _no_credentials(monkeypatch, tmp_path)
    bare = BareS3Server()
    try:
        with pytest.raises(ObjectStoreError, match="returned other bytes than were written") \
                as e:
            check_storage(bare.uri("runs"), endpoint=bare.endpoint)
    finally:
        bare.stop()
    assert "AWS_ACCESS_KEY_ID" in _one_line(e.value)


def test_storage_serve_refuses_a_client_without_its_key(s3, monkeypatch, tmp_path):
    """``ray-mesh storage serve`` answers no anonymous request: the check names the fix."""
    _no_credentials(monkeypatch, tmp_path)
    with pytest.raises(ObjectStoreError, match="is denied") as e:
        check_storage(s3.uri("runs"), endpoint=s3.endpoint)
    assert "AWS_ACCESS_KEY_ID" in _one_line(e.value)


def test_the_cli_refuses_a_missing_bucket_in_one_line_before_ray(s3, signed, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"train: {TRAIN}\nmesh: ddp\nscaling: {{num_workers: 2}}\n")
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "ray_mesh.cli", "run", str(job), "--storage-path",
         "s3://missing-bucket/runs", "--storage-endpoint", s3.endpoint],
        capture_output=True, text=True, timeout=120, cwd=REPO)
    took = time.monotonic() - t0
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ray-mesh: error: storage s3://"), lines
    assert "bucket 'missing-bucket' does not exist" in lines[0]
    assert "Started a local Ray instance" not in res.stdout + res.stderr
    print(f"refused in {took:.1f} s (interpreter start included)")


# ----------------------------------------------------------------------------- credentials
@pytest.fixture(scope="module")
def locked():
    server = AuthS3Server()
    yield server
    server.stop()


@pytest.mark.parametrize("who, expect", [
    ("unknown-key", "does not know the access key id"),
    ("wrong-secret", "the secret key does not match"),
    ("read-only", "refuses writes"),
    ("read-write", None),
])
def test_credentials_are_checked_and_never_printed(locked, monkeypatch, who, expect):
    key = {"unknown-key": ("AKIAUNKNOWN0000000", "whatever"),
           "wrong-secret": (locked.rw[0], "not-the-secret"),
           "read-only": locked.ro, "read-write": locked.rw}[who]
    # pyarrow resolves the AWS credentials per filesystem: the environment of the moment
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key[1])
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    uri = f"s3://{locked.bucket}/runs"
    if expect is None:
        assert check_storage(uri, endpoint=locked.endpoint) == uri
        return
    with pytest.raises(ObjectStoreError, match=expect) as err:
        check_storage(uri, endpoint=locked.endpoint)
    line = _one_line(err.value)
    assert key[1] not in line and key[0] not in line  # no key in the message
    if who != "read-only":  # the fix names where the credentials come from
        assert "AWS_ACCESS_KEY_ID" in line, line


# ----------------------------------------------------------------------------- settings
def test_run_storage_is_ray_trains_own_pair_without_credentials(monkeypatch):
    import pickle

    import ray_mesh

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-in-the-filesystem")
    kw = ray_mesh.run_storage("s3://ckpt-bucket/runs/", "http://10.0.0.5:9000")
    assert kw["storage_path"] == "ckpt-bucket/runs"  # the path inside the filesystem
    fs = kw["storage_filesystem"]
    assert fs.type_name == "s3"
    assert b"never-in-the-filesystem" not in pickle.dumps(fs)  # shipped to every worker
    options = fs.__reduce__()[1][0]
    assert options["endpoint_override"] == "10.0.0.5:9000" and options["scheme"] == "http"
    assert options["access_key"] is None and options["secret_key"] is None
    assert ray_mesh.run_storage("/shared/results") == {"storage_path": "/shared/results"}
    with pytest.raises(StorageURIError, match="storage_path is not"):
        ray_mesh.run_storage(None, "http://10.0.0.5:9000")


def test_cli_flags_override_the_job_and_go_through_its_checks(tmp_path):
    job = Job.from_dict({"train": TRAIN, "run": {"storage_path": str(tmp_path)}})
    moved = job.with_storage("s3://ckpt-bucket/runs", "https://minio.lan:9000")
    assert (moved.run.storage_path, moved.run.storage_endpoint) == (
        "s3://ckpt-bucket/runs", "https://minio.lan:9000")
    with pytest.raises(JobError, match="is a local path"):
        job.with_storage(None, "http://minio.lan:9000")  # the file's local path stays


def test_status_matches_a_bucket_however_it_is_spelled():
    from hostile_dashboard import train_run

    from ray_mesh.observability.layout import named_storage
    from ray_mesh.observability.status_input import parse_run

    r = train_run("hsdp", storage="ckpt-bucket/runs")
    r["run_settings"]["run_config"]["storage_filesystem"] = (
        "<pyarrow._s3fs.S3FileSystem object at 0x7f00>")
    run = parse_run(r)
    assert run["storage_raw"] == run["storage_path"] == "s3://ckpt-bucket/runs"
    for viewer in ("s3://ckpt-bucket/runs", "s3://ckpt-bucket/runs/",
                   "s3://ckpt-bucket/runs?endpoint_override=h:9000&scheme=http"):
        assert named_storage(run["storage_raw"], [viewer]) == viewer
    assert named_storage(run["storage_raw"], ["s3://ckpt-bucket/other"]) is None
    assert named_storage(run["storage_raw"], ["ckpt-bucket/runs"]) is None  # a local path
    # a plain local path recorded without an S3 filesystem stays a local path
    assert parse_run(train_run("hsdp", storage="ckpt-bucket/runs"))["storage_raw"] == \
        "ckpt-bucket/runs"
