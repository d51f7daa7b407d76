"""A checkpoint crafted by someone who can write the storage runs nothing when loaded.

The attack (Security round 2, item 1): declare a key of the model or optimizer as a bytes
entry (``BytesStorageMetadata``) in ``.metadata``, point it at a shard holding a
``torch.save``d object whose ``__reduce__`` runs code, and recompute the integrity manifest
(anyone who can write the files can). DCP's default planner reads bytes entries with
``torch.load(weights_only=False)``; ray_mesh's loader must refuse with a
:class:`CheckpointError` naming the file and the key, and never run the payload. Round 3 adds
a ``.metadata`` that changes the process without running code (``BUILD`` on a shared enum
member or function), entries DCP would decompress before any check (``transform_descriptors``)
and a ``.metadata`` too large to read. Real DCP, one process, no process group.
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


def test_restricted_unpickler_refuses_build_on_a_type(tmp_path):
    """``BUILD`` on a class would set class attributes in the loading process."""
    from torch.distributed.checkpoint.metadata import Metadata

    # GLOBAL Metadata, then BUILD (None, {"x": 1}): setattr(Metadata, "x", 1)
    data = (b"\x80\x04c" + b"torch.distributed.checkpoint.metadata\nMetadata\n"
            + b"N}\x8c\x01x\x94K\x01s\x86b.")
    path = tmp_path
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


# ----------------------------------------------------------------------------- round 3
def _global(module: str, name: str) -> bytes:
    """Pickle opcodes pushing ``module.name`` (SHORT_BINUNICODE x2, STACK_GLOBAL)."""
    return b"".join(b"\x8c" + bytes([len(x)]) + x.encode() for x in (module, name)) + b"\x93"


def _str(text: str) -> bytes:
    return b"\x8c" + bytes([len(text)]) + text.encode()


# BUILD on an object every checkpoint of the process shares, then POP: the real metadata
# follows, so the file is a complete, valid DCP .metadata with one extra change in front.
_POISON = {
    # _MEM_FORMAT_ENCODING(0)._value_ = 7: every later save writes 7, which no load accepts
    "enum member": _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
    + b"K\x00\x85R}" + _str("_value_") + b"K\x07sb0",
    # torch.serialization._get_layout.cache = {"x": 1}: every later layout lookup fails
    "function": _global("torch.serialization", "_get_layout")
    + b"}" + _str("cache") + b"}" + _str("x") + b"K\x01ssb0",
}


@pytest.mark.parametrize("target", sorted(_POISON))
def test_build_on_a_shared_object_is_refused_and_changes_nothing(tmp_path, target):
    """Round 3, item 2: a crafted ``.metadata`` that BUILDs an enum member or the permitted
    function ``_get_layout`` is refused, and this process's later saves still load."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    from torch.serialization import _get_layout

    member = _MEM_FORMAT_ENCODING(0)
    before = (dict(vars(member)), dict(vars(_get_layout)))
    path, _, _ = _saved(tmp_path / "checkpoint_00000001")
    meta = path / integrity.METADATA
    meta.write_bytes(b"\x80\x04" + _POISON[target] + meta.read_bytes())
    sharded.mark_complete(path, sharded.Progress(1))  # the manifest vouches for it
    try:
        fresh = _model()
        with pytest.raises(CheckpointError, match=r"BUILD to .*only DCP's metadata "
                                                  r"dataclasses.*resume from another"):
            sharded.load(path, fresh, torch.optim.AdamW(fresh.parameters()))
        assert (dict(vars(member)), dict(vars(_get_layout))) == before
        later, model, opt = _saved(tmp_path / "checkpoint_00000002")  # this process saves
        fresh = _model()
        sharded.load(later, fresh, torch.optim.AdamW(fresh.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(),
                                                     strict=True))
    finally:  # the process as it was, whatever happened above
        vars(member).update(before[0])
        vars(_get_layout).clear()
        vars(_get_layout).update(before[1])


def _zstd_bomb(mib: int) -> bytes:
    """A zstd frame of RLE blocks (4 bytes each) expanding to ``mib`` MiB of zeros."""
    blocks = mib * 8  # 128 KiB each
    head = b"\x28\xb5\x2f\xfd\x00\x38"  # magic, no content size, window 2**17
    return head + b"".join(
        (((128 << 10) << 3) | (1 << 1) | (i == blocks - 1)).to_bytes(3, "little") + b"\0"
        for i in range(blocks))


def test_transformed_entries_are_refused_before_any_read(tmp_path):
    """Round 3, item 3: an entry declared zstd-compressed (``transform_descriptors``) would be
    expanded by DCP in memory before anything checks it; ray_mesh writes none: refused while
    the metadata is checked, naming the key and the file."""
    path, _, _ = _saved(tmp_path / "checkpoint_00000001")
    meta = pickle.loads((path / integrity.METADATA).read_bytes())
    bomb = _zstd_bomb(16)  # 1 KiB of file, 16 MiB once expanded
    (path / "__0_1.distcp").write_bytes(bomb)
    key = "optim.param_groups.0.lr"
    index = next(i for i in meta.storage_data if i.fqn == key)
    meta.storage_data[index] = _StorageInfo("__0_1.distcp", 0, len(bomb), ["stream.zstd/1"])
    (path / integrity.METADATA).write_bytes(pickle.dumps(meta))
    sharded.mark_complete(path, sharded.Progress(1))
    why = sharded.loadable_problem(path)
    assert why and key in why and "__0_1.distcp" in why and "transformed" in why, why
    fresh = _model()
    with pytest.raises(CheckpointError, match=r"stream\.zstd/1.*resume from another"):
        sharded.load(path, fresh, torch.optim.AdamW(fresh.parameters()))


def test_metadata_over_the_size_cap_is_refused_unread(tmp_path, monkeypatch):
    """Round 3, item 8: ``.metadata`` size is checked before it is read. A valid pickle with
    trailing junk (the unpickler stops at STOP) over the cap: refused by size, naming the
    setting that raises the cap; a sparse file just over the default cap is refused without
    reading a byte; a wrong setting is named."""
    path, _, _ = _saved(tmp_path / "checkpoint_00000001")
    meta = path / integrity.METADATA
    meta.write_bytes(meta.read_bytes() + b"\0" * (128 << 10))
    sharded.mark_complete(path, sharded.Progress(1))
    monkeypatch.setenv("RAY_MESH_METADATA_MAX_BYTES", str(64 << 10))
    with pytest.raises(CheckpointError, match=r"over the 65536-byte cap.*"
                                              r"RAY_MESH_METADATA_MAX_BYTES"):
        sharded.load(path, _model(), verify=False)
    with pytest.raises(ValueError, match="over the 65536-byte cap"):
        integrity.read_metadata(path)
    monkeypatch.setenv("RAY_MESH_METADATA_MAX_BYTES", "lots")
    assert "RAY_MESH_METADATA_MAX_BYTES='lots' is not a number" in sharded.problem(path)
    monkeypatch.delenv("RAY_MESH_METADATA_MAX_BYTES")
    sharded.load(path, _model(), verify=False)  # under the default cap: loads
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    with open(sparse / integrity.METADATA, "wb") as f:
        f.truncate(integrity.METADATA_MAX_BYTES + 1)  # no disk, and never read
    with pytest.raises(ValueError, match=f"{integrity.METADATA_MAX_BYTES + 1} bytes, over"):
        integrity.read_metadata(sparse)
