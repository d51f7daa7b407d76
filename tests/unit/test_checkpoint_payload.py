"""A checkpoint crafted by someone who can write the storage runs nothing when loaded.

The attack (Security round 2, item 1): declare a key of the model or optimizer as a bytes
entry (``BytesStorageMetadata``) in ``.metadata``, point it at a shard holding a
``torch.save``d object whose ``__reduce__`` runs code, and recompute the integrity manifest
(anyone who can write the files can). DCP's default planner reads bytes entries with
``torch.load(weights_only=False)``; ray_mesh's loader must refuse with a
:class:`CheckpointError` naming the file and the key, and never run the payload. Real DCP, one
process, no process group.
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ray_mesh.checkpointing import integrity, sharded
from ray_mesh.errors import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FLAG_ENV = "RAY_MESH_TEST_PAYLOAD_FLAG"


class _Payload:
    """Unpickling this creates the file named in ``FLAG_ENV``'s value at pickling time."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        return (os.mkdir, (str(self.flag),))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _saved(path: Path, optim: bool = True) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = sharded.prepare_dir(path, None)
    sharded.save(path, model, opt if optim else None)
    sharded.mark_complete(path, sharded.Progress(1))
    return path, model, opt


def _plant(path: Path, key: str, obj: object) -> str:
    """Declare ``key`` a bytes entry of a new shard holding ``torch.save(obj)``; re-mark.

    Returns the shard's name. Uses only what a writer of the storage has: the files.
    """
    meta = pickle.loads((path / integrity.METADATA).read_bytes())
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    shard = "__0_1.distcp"
    (path / shard).write_bytes(data)
    for index in [i for i in meta.storage_data if i.fqn == key]:
        del meta.storage_data[index]
    meta.state_dict_metadata[key] = BytesStorageMetadata()
    meta.storage_data[MetadataIndex(key)] = _StorageInfo(shard, 0, len(data))
    (path / integrity.METADATA).write_bytes(pickle.dumps(meta))
    sharded.mark_complete(path, sharded.Progress(1))  # the manifest now vouches for it
    return shard


@pytest.mark.parametrize("key", ["model.0.weight", "optim.param_groups.0.lr"])
def test_a_pickled_payload_never_runs_on_load(tmp_path, key):
    """A tensor key turned into a bytes entry, and a real bytes entry (the learning rate)
    holding a payload: both refused, naming the file and the key, and the payload never ran."""
    path, model, opt = _saved(tmp_path / "checkpoint_00000001")
    flag = tmp_path / "payload_ran"
    shard = _plant(path, key, _Payload(flag))
    assert sharded.problem(path, verify=True) is None  # the manifest is no defence
    fresh = _model()
    with pytest.raises(CheckpointError) as err:
        sharded.load(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.5))
    assert not flag.exists(), "the checkpoint's payload ran during load"
    msg = str(err.value)
    assert key in msg and shard in msg and str(path) in msg, msg


def test_plain_bytes_entries_still_load(tmp_path):
    """What DCP legitimately stores as bytes (an optimizer's floats, lists) loads as before."""
    path, model, opt = _saved(tmp_path / "checkpoint_00000001")
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    sharded.load(path, fresh, fresh_opt)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(0.01)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bytes_planted_where_a_tensor_is_expected_is_refused_before_reading(tmp_path):
    """Plain data (no payload) declared as bytes for a weight: refused by name, not a crash."""
    path, _, _ = _saved(tmp_path / "checkpoint_00000001", optim=False)
    _plant(path, "model.1.bias", [1, 2, 3])
    with pytest.raises(CheckpointError, match=r"model\.1\.bias.*tensor"):
        sharded.load(path, _model())


def test_metadata_is_read_once(tmp_path, monkeypatch):
    """DCP never re-reads ``.metadata`` with plain pickle after the restricted check: a
    ``pickle.load`` of it during ``load`` fails the test (the race the issue names)."""
    path, _, _ = _saved(tmp_path / "checkpoint_00000001")
    real_load = pickle.load

    def spy(f, *a, **kw):
        assert integrity.METADATA not in str(getattr(f, "name", "")), \
            "DCP re-read .metadata with plain pickle"
        return real_load(f, *a, **kw)

    monkeypatch.setattr(pickle, "load", spy)
    fresh = _model()
    sharded.load(path, fresh, torch.optim.AdamW(fresh.parameters()))


def test_restricted_unpickler_refuses_build_on_a_type():
    """``BUILD`` on a class would set class attributes in the loading process."""
    from torch.distributed.checkpoint.metadata import Metadata

    # GLOBAL Metadata, then BUILD (None, {"x": 1}): setattr(Metadata, "x", 1)
    data = (b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nMetadata\n"
            + b"N}\x8c\x01x\x94K\x01s\x86b.")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"build_{os.getpid()}"
    path.mkdir(exist_ok=True)
    (path / integrity.METADATA).write_bytes(data)
    with pytest.raises(ValueError, match="BUILD"):
        integrity.read_metadata(path)
    assert not hasattr(Metadata, "x")


def test_json_temp_files_follow_no_symlink(tmp_path):
    """A symlink planted at the temporary name is never written through."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "marker.json"
    (tmp_path / "marker.json.tmp").symlink_to(victim)
    integrity.write_json_atomic(target, {"a": 1})
    assert victim.read_text() == "keep"
    assert target.is_file() and not target.is_symlink()


def test_local_checkpoint_files_are_not_world_readable(tmp_path):
    path, _, _ = _saved(tmp_path / "checkpoint_00000001")
    assert not stat.S_IMODE(path.stat().st_mode) & 0o007
    for f in path.iterdir():
        assert not stat.S_IMODE(f.stat().st_mode) & 0o007, f.name
