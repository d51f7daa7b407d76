"""The replica groups' fallback checkpoint in a bucket, without Ray: written locally and
uploaded in the background, recorded by the quorum only once its upload is whole, restored;
a failed upload reported, not lost; a missing or unreachable bucket refused on the driver
before any group starts.

Real parts: a moto S3 server process (``ray-mesh storage serve``, tests/helpers/moto_s3.py),
a real :class:`~ray_mesh.replicas.quorum.Quorum`, DCP and the integrity manifest, and the
driver's storage probe (``check_storage``, the one-mesh path's). A group of one process here;
a restore into a group of another layout (FSDP2 to tp) under torchrun is
tests/dist/test_replica_layouts.py.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from moto_s3 import S3Server
from ports import free_port

from harness.replica_train import make_model, samples
from ray_mesh.checkpointing import upload
from ray_mesh.checkpointing.integrity import MANIFEST, MARKER
from ray_mesh.errors import CheckpointError, ConfigurationError, ObjectStoreError
from ray_mesh.replicas.fallback import Fallback
from ray_mesh.replicas.quorum import Quorum
from ray_mesh.replicas.state import materialize, tensors_and_likes


@pytest.fixture(scope="module")
def s3():
    server = S3Server(bucket="fallback-unit")
    yield server
    server.stop()


@pytest.fixture
def signed(s3, monkeypatch):
    """The server's key, as every node exports it."""
    for k, v in s3.credentials.items():
        monkeypatch.setenv(k, v)


class _Client:
    """A group's checkpoint calls to the run's coordinator, into a real Quorum, recorded."""

    def __init__(self, quorum: Quorum) -> None:
        self.quorum, self.calls = quorum, []

    def checkpoint_started(self, step):
        self.calls.append(("started", step))
        self.quorum.checkpoint_started(step)

    def checkpointed(self, step, path):
        self.calls.append(("checkpointed", step, path))
        self.quorum.checkpointed(step, path)

    def checkpoint_failed(self, gid, step, error):
        self.calls.append(("failed", step, error))
        self.quorum.checkpoint_failed(gid, step, error)


def _group_state():
    """A trained step's state list (parameters, SGD momentum, counters) of one rank."""
    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    materialize(optim)
    x, y = samples(list(range(8)))
    torch.nn.functional.mse_loss(model(x), y).backward()
    optim.step()
    return tensors_and_likes(model, optim, None, torch.tensor([2, 0, 0]))


def _assert_restores(fallback: Fallback, uri: str, state, likes) -> None:
    """Zero the state, restore ``uri`` into it: it comes back equal to what was saved."""
    saved = [t.clone() for t in state]
    for t in state:
        t.zero_()
    fallback.restore(uri, state, likes)
    for a, b in zip(saved, state, strict=True):
        assert torch.equal(a, b)


def _read(s3: S3Server, uri: str, name: str) -> bytes:
    with s3.filesystem().open_input_stream(f"{uri[len('s3://'):]}/{name}") as f:
        return f.read()


def test_the_fallback_is_recorded_only_once_its_upload_is_whole_and_restores(
        s3, signed, monkeypatch):
    quorum = Quorum(segment_samples=4, total_steps=100)
    client = _Client(quorum)
    gate, real = threading.Event(), upload.upload_dir

    def held_back(*args, **kwargs):  # the upload waits until the test lets it go
        assert gate.wait(60), "the test never released the upload"
        return real(*args, **kwargs)

    monkeypatch.setattr(upload, "upload_dir", held_back)
    location = s3.uri("runs/rg-fallback")
    fallback = Fallback(location, client, 0, every=2, endpoint=s3.endpoint, keep=2)
    state, likes = _group_state()
    assert fallback.due(4) and not fallback.due(3) and not fallback.due(0)

    t0 = time.perf_counter()
    assert fallback.save(2, state, likes)
    assert time.perf_counter() - t0 < 10  # the local write only: the upload is held back
    time.sleep(0.5)
    assert client.calls == [("started", 2)]
    assert quorum.status()["checkpoint"] is None  # still uploading: not the fallback yet
    assert upload.complete(location, s3.endpoint) == []
    assert not fallback.save(4, state, likes)  # step 2 still uploads: skipped, not waited on

    gate.set()
    fallback.close(timeout_s=60)
    step, uri = quorum.status()["checkpoint"]
    assert step == 2 and uri.startswith(f"{location}/checkpoint_00000002_"), uri
    assert client.calls == [("started", 2), ("checkpointed", 2, uri)]
    assert fallback.uploaded["step"] == 2 and fallback.uploaded["bytes"] > 10_000
    files = json.loads(_read(s3, uri, MANIFEST))["files"]
    assert {".metadata", "__0_0.distcp"} <= set(files), files  # DCP, with its manifest
    assert json.loads(_read(s3, uri, MARKER))["step"] == 2

    _assert_restores(fallback, uri, state, likes)

    for step in (4, 6, 8):  # num_to_keep=2: the two newest stay in the bucket
        assert fallback.save(step, state, likes)
        fallback.close(timeout_s=60)
    assert [s for s, _ in upload.complete(location, s3.endpoint)] == [8, 6]
    assert quorum.status()["checkpoint"][0] == 8 and not fallback.errors


def test_a_local_checkpoint_dir_is_recorded_and_restores(tmp_path):
    """``checkpoint_dir`` on a filesystem every node mounts (no endpoint): the same path
    through :class:`Fallback` as a bucket, DCP shards and manifest in the directory; the
    run's restore of it under Ray is tests/ray/test_replica_groups_ray.py's, from a bucket."""
    quorum = Quorum(segment_samples=4, total_steps=100)
    client = _Client(quorum)
    location = str(tmp_path / "ckpt")
    fallback = Fallback(location, client, 0, every=2, keep=1)
    state, likes = _group_state()
    for step in (2, 4):
        assert fallback.save(step, state, likes)
        fallback.close(timeout_s=60)
    step, uri = quorum.status()["checkpoint"]
    assert step == 4 and uri.startswith(f"{location}/checkpoint_00000004_"), uri
    assert [s for s, _ in upload.complete(location, None)] == [4]  # num_to_keep=1
    files = json.loads((tmp_path / "ckpt" / uri.rsplit("/", 1)[1] / MANIFEST).read_text())
    assert {".metadata", "__0_0.distcp"} <= set(files["files"]), files
    _assert_restores(fallback, uri, state, likes)
    assert not fallback.errors


def test_a_restore_refuses_a_checkpoint_changed_in_the_bucket(s3, signed):
    quorum = Quorum(segment_samples=4, total_steps=100)
    fallback = Fallback(s3.uri("runs/rg-tamper"), _Client(quorum), 0, every=1,
                        endpoint=s3.endpoint)
    state, likes = _group_state()
    fallback.save(1, state, likes)
    fallback.close(timeout_s=60)
    uri = quorum.status()["checkpoint"][1]
    shard = bytearray(_read(s3, uri, "__0_0.distcp"))
    shard[len(shard) // 2] ^= 1  # one bit, same length
    with s3.filesystem().open_output_stream(f"{uri[len('s3://'):]}/__0_0.distcp") as f:
        f.write(bytes(shard))
    with pytest.raises(CheckpointError, match=r"cannot be restored: shard __0_0.distcp is "
                       r"corrupt: its SHA-256 differs"):
        fallback.restore(uri, state, likes)


def test_a_failed_upload_is_reported_and_the_fallback_stays_the_previous(monkeypatch,
                                                                         caplog):
    server = S3Server(bucket="fallback-down")
    for k, v in server.credentials.items():
        monkeypatch.setenv(k, v)
    quorum = Quorum(segment_samples=4, total_steps=100)
    client = _Client(quorum)
    try:
        fallback = Fallback(server.uri("runs/rg"), client, 3, every=2,
                            endpoint=server.endpoint)
        state, likes = _group_state()
        fallback.save(2, state, likes)
        fallback.close(timeout_s=60)
        assert quorum.status()["checkpoint"][0] == 2
    finally:
        server.stop()  # the lab's server goes away
    t0 = time.monotonic()
    assert fallback.save(4, state, likes)  # written locally: the group goes on
    fallback.close(timeout_s=120)
    assert time.monotonic() - t0 < 100  # every request bounded
    assert quorum.status()["checkpoint"][0] == 2  # the fallback stays the previous
    unsaved = [e for e in quorum.status()["events"] if e["kind"] == "unsaved"]
    assert len(unsaved) == 1 and unsaved[0]["step"] == 4 and unsaved[0]["group"] == 3
    assert unsaved[0]["detail"].startswith(
        f"the fallback checkpoint of step 4 is not in {server.uri('runs/rg')} at "
        f"{server.endpoint}: "), unsaved
    assert "stays the previous one; check the storage" in unsaved[0]["detail"]
    assert [c[0] for c in client.calls] == ["started", "checkpointed", "started", "failed"]
    assert fallback.errors == [unsaved[0]["detail"]]
    assert any("is not in" in r.getMessage() for r in caplog.records
               if r.levelname == "ERROR")


def test_an_upload_past_its_bound_stops_and_leaves_no_marker(tmp_path, s3, signed):
    quorum = Quorum(segment_samples=4, total_steps=100)
    fallback = Fallback(str(tmp_path / "staged"), _Client(quorum), 0, every=1)
    state, likes = _group_state()
    fallback.save(1, state, likes)
    fallback.close(timeout_s=60)
    local = tmp_path / "staged"
    [done] = [p for p in local.iterdir() if p.name.startswith("checkpoint_00000001_")]
    with pytest.raises(CheckpointError, match=r"did not finish within -1 s"):
        upload.upload_dir(done, s3.uri("runs/late/ck"), s3.endpoint, deadline_s=-1)
    assert upload.complete(s3.uri("runs/late"), s3.endpoint) == []


def _no_start(monkeypatch):
    """Starting the coordinator or a group fails the test: refusals come before."""
    import ray_mesh.raytrain.replica_groups as rg

    def started(*args, **kwargs):
        raise AssertionError("the coordinator or a group started before the refusal")

    monkeypatch.setattr(rg, "warm_controller_actors", started)
    monkeypatch.setattr(rg, "Coordinator", SimpleNamespace(options=started))
    monkeypatch.setattr(rg, "_GroupRunner", SimpleNamespace(options=started))
    return rg.fit_replica_groups


@pytest.mark.parametrize(("where", "expect"), [
    ("storage", "bucket 'no-such-bucket' does not exist. Create it"),
    ("fallback", "bucket 'no-such-bucket' does not exist. Create it"),
    ("closed", "refused the connection: no S3 server listens"),
])
def test_a_missing_or_unreachable_bucket_is_refused_before_any_group_starts(
        s3, signed, monkeypatch, tmp_path, where, expect):
    import ray

    fit = _no_start(monkeypatch)
    endpoint = f"http://127.0.0.1:{free_port()}" if where == "closed" else s3.endpoint
    storage = {"storage": ("s3://no-such-bucket/runs", None),
               "fallback": (s3.uri("runs"), "s3://no-such-bucket/fallback"),
               "closed": (s3.uri("runs"), None)}[where]
    with pytest.raises(ObjectStoreError, match=expect) as err:
        fit(lambda config: None, groups=2, workers_per_group=1, total_steps=4,
            segment_samples=4, name="rg", storage_path=storage[0], storage_endpoint=endpoint,
            checkpoint_every=2, checkpoint_dir=storage[1])
    assert "\n" not in str(err.value)
    assert not ray.is_initialized()


@pytest.mark.parametrize(("kwargs", "expect"), [
    ({"num_to_keep": 0}, "num_to_keep=0: give how many fallback checkpoints"),
    ({"checkpoint_every": -1}, "checkpoint_every=-1"),
    ({"max_group_failures": -2}, "max_group_failures=-2: .* -1 for no limit"),
    ({"upload_timeout_s": 0}, "upload_timeout_s=0"),
])
def test_bad_fallback_settings_are_refused_by_name(monkeypatch, kwargs, expect):
    fit = _no_start(monkeypatch)
    with pytest.raises(ConfigurationError, match=expect):
        fit(lambda config: None, groups=1, workers_per_group=1, total_steps=4,
            segment_samples=4, **kwargs)


def test_the_fallback_defaults_to_the_runs_storage():
    from ray_mesh.raytrain.replica_storage import fallback_location

    assert fallback_location("s3://b/runs", "rg", None) == "s3://b/runs/rg-fallback"
    assert fallback_location("s3://b/runs?scheme=http", "rg", None) == \
        "s3://b/runs/rg-fallback?scheme=http"
    assert fallback_location("s3://b/runs", "rg", "/shared/ckpt") == "/shared/ckpt"
