"""Checkpoint trust and integrity, in one process (real DCP, no process group).

* a crafted ``.metadata`` never runs: scanning, ``problem()``, ``newest_complete()`` and
  ``load()`` do not execute it, and a checkpoint holding one is skipped with a warning;
* bad markers, corruption that keeps a file's length, zeroed shards: named, never a crash;
* NaN weights are refused; a directory ray_mesh did not create is never replaced;
* random state round trip.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from ray_mesh.checkpointing import integrity, rng, sharded

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _write(path: Path, step: int, model: nn.Module | None = None) -> Path:
    model = model or _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    path = sharded.prepare_dir(path, None)
    sharded.save(path, model, optim)
    sharded.mark_complete(path, sharded.Progress(step, {"offset": step}))
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("ck") / "checkpoint_00000003", 3)


def _copy(good: Path, tmp_path: Path, step: int) -> Path:
    dst = tmp_path / sharded.dir_name(step)
    shutil.copytree(good, dst)
    return dst


def _refresh_manifest(path: Path) -> None:
    """What an attacker who can write the storage can do too: make the manifest match."""
    manifest = json.loads((path / integrity.MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"size": (path / name).stat().st_size,
                                   "sha256": integrity.sha256_file(path / name)}
    (path / integrity.MANIFEST).write_text(json.dumps(manifest))


class _Touch:
    def __init__(self, flag: Path, how: str) -> None:
        self.flag, self.how = str(flag), how

    def __reduce__(self):
        if self.how == "system":
            return os.system, (f"touch {self.flag}",)
        return open, (self.flag, "w")  # creating a file on unpickling is enough


def test_layout_of_a_checkpoint(good):
    names = {p.name for p in good.iterdir()}
    assert {integrity.OWNED, integrity.MANIFEST, sharded.MARKER, ".metadata",
            rng.file_name(0)} <= names, names
    files = json.loads((good / integrity.MANIFEST).read_text())["files"]
    assert set(files) == {".metadata", rng.file_name(0), "__0_0.distcp"}
    assert sharded.problem(good) is None and sharded.problem(good, verify=True) is None
    assert sharded.loadable_problem(good) is None


@pytest.mark.parametrize("how", ["system", "open"])
@pytest.mark.parametrize("refresh", [False, True])
def test_crafted_metadata_never_runs(good, tmp_path, how, refresh):
    older = _copy(good, tmp_path, 3)
    flag = tmp_path / "pwned"
    evil = _copy(good, tmp_path, 6)
    (evil / ".metadata").write_bytes(pickle.dumps(_Touch(flag, how)))
    if refresh:
        _refresh_manifest(evil)
    newest = _copy(good, tmp_path, 9)
    (newest / sharded.MARKER).unlink()  # forces the scan past it to the crafted one

    why = sharded.problem(evil)
    assert (why is None) == refresh  # a size mismatch is found without unpickling anything
    siblings = sharded.older_siblings(newest)
    assert siblings == [evil, older]
    chosen, warns = sharded.newest_complete([newest, *siblings])
    assert chosen == str(older), warns
    assert any(str(evil) in w for w in warns), warns
    with pytest.raises(sharded.CheckpointError, match=str(evil)):
        sharded.load(evil, _model(1))
    assert not flag.exists(), "the crafted .metadata ran"


def test_metadata_of_the_wrong_type_is_skipped(good, tmp_path):
    older = _copy(good, tmp_path, 3)
    odd = _copy(good, tmp_path, 6)
    (odd / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    _refresh_manifest(odd)
    chosen, warns = sharded.newest_complete([odd, older])
    assert chosen == str(older)
    assert "not DCP Metadata" in warns[0] and str(odd) in warns[0], warns


@pytest.mark.parametrize("marker, reason", [
    ({}, "no valid step"),
    ({"step": "3"}, "no valid step"),
    ({"step": -1}, "no valid step"),
    ({"step": 2.5}, "no valid step"),
    ({"step": True}, "no valid step"),
    ([1, 2], "not a JSON object"),
    ("step", "not a JSON object"),
    ({"step": 3, "data_position": [1]}, "malformed 'data_position'"),
])
def test_bad_markers_say_why(good, tmp_path, marker, reason):
    bad = _copy(good, tmp_path, 6)
    (bad / sharded.MARKER).write_text(json.dumps(marker))
    assert reason in sharded.problem(bad)
    with pytest.raises(sharded.CheckpointError, match=reason):
        sharded.read_progress(bad)
    chosen, warns = sharded.newest_complete([bad, _copy(good, tmp_path, 3)])
    assert chosen.endswith("checkpoint_00000003") and reason in warns[0]
    (bad / sharded.MARKER).write_text("{not json")
    assert "unreadable" in sharded.problem(bad)
    (bad / sharded.MARKER).write_text("[" * 100000 + "]" * 100000)
    assert "unreadable" in sharded.problem(bad)


def test_bad_manifest_says_why(good, tmp_path):
    bad = _copy(good, tmp_path, 6)
    (bad / integrity.MANIFEST).unlink()
    assert f"no {integrity.MANIFEST}" in sharded.problem(bad)
    (bad / integrity.MANIFEST).write_text(json.dumps({"files": {"../../x": {}}}))
    assert "lists no files" in sharded.problem(bad)
    (bad / integrity.MANIFEST).write_text(json.dumps(
        {"files": {".metadata": {"size": 1, "sha256": "0"}, "../x": {"size": 1, "sha256": "0"}}}))
    assert "malformed entry '../x'" in sharded.problem(bad)


def test_same_length_corruption_is_found_and_named(good, tmp_path):
    older = _copy(good, tmp_path, 3)
    bad = _copy(good, tmp_path, 6)
    shard = bad / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in the middle: the length stays
    shard.write_bytes(bytes(data))
    assert sharded.problem(bad) is None  # sizes alone cannot tell
    why = sharded.problem(bad, verify=True)
    assert "__0_0.distcp" in why and "corrupt" in why
    chosen, warns = sharded.newest_complete([bad, older])
    assert chosen == str(older) and "__0_0.distcp is corrupt" in warns[0]
    with pytest.raises(sharded.CheckpointError, match="__0_0.distcp is corrupt"):
        sharded.load(bad, _model(1), None)


@pytest.mark.parametrize("damage", ["zeros", "header"])
def test_unreadable_shard_is_a_checkpoint_error(good, tmp_path, damage):
    bad = _copy(good, tmp_path, 6)
    shard = bad / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "zeros":
        data = bytearray(len(data))
    else:
        for i in range(16):
            data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(sharded.CheckpointError, match="corrupt"):
        sharded.load(bad, _model(1), None)  # found by the checksum
    if damage == "zeros":  # without the checksum DCP itself fails: a CheckpointError too
        with pytest.raises(sharded.CheckpointError, match="DCP could not read.*"
                                                          "load again with verify=True"):
            sharded.load(bad, _model(1), None, verify=False)


def test_unreadable_shard_that_passed_verification_says_so(good, tmp_path):
    """Round 3, item 8: a shard DCP cannot read although it matches the manifest (written that
    way, or altered with the manifest): the error does not advise verify=True, which ran."""
    bad = _copy(good, tmp_path, 6)
    shard = bad / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))
    _refresh_manifest(bad)
    with pytest.raises(sharded.CheckpointError) as err:
        sharded.load(bad, _model(1), None, verify=True)
    msg = str(err.value)
    assert "DCP could not read" in msg and "matches the SHA-256 recorded at save" in msg, msg
    assert "verify=True" not in msg, msg


def test_load_restores_model_progress_and_rng(good, tmp_path):
    model = _model(5)
    progress = sharded.load(good, model, torch.optim.AdamW(model.parameters()))
    assert (progress.step, progress.data_position, progress.warnings) == (3, {"offset": 3}, [])
    ck = _copy(good, tmp_path, 6)
    (ck / rng.file_name(0)).unlink()  # as from a ray_mesh that saved no random state
    manifest = json.loads((ck / integrity.MANIFEST).read_text())
    del manifest["files"][rng.file_name(0)]
    (ck / integrity.MANIFEST).write_text(json.dumps(manifest))
    progress = sharded.load(ck, _model(5))
    assert "no random state for rank 0" in progress.warnings[0]


def test_non_finite_weights_are_refused(tmp_path):
    model = _model()
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    path = sharded.prepare_dir(tmp_path / "checkpoint_00000001", None)
    with pytest.raises(sharded.NonFiniteError, match=r"NaN or inf \(parameters 2.bias"):
        sharded.save(path, model)
    assert not list(path.glob("*.distcp"))
    sharded.save(path, model, check_finite=False)  # explicitly allowed
    assert list(path.glob("*.distcp"))


def test_prepare_dir_replaces_only_its_own(tmp_path):
    foreign = tmp_path / "checkpoint_000005"
    foreign.mkdir()
    (foreign / "model.pt").write_text("someone else's")
    with pytest.raises(sharded.CheckpointError, match="not created by ray_mesh"):
        sharded.prepare_dir(foreign, None)
    assert (foreign / "model.pt").read_text() == "someone else's"
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(sharded.CheckpointError, match="not a directory ray_mesh created"):
        sharded.prepare_dir(tmp_path / "a_file", None)
    ours = sharded.prepare_dir(tmp_path / "checkpoint_00000007", None)
    (ours / "__0_0.distcp").write_text("half written")
    again = sharded.prepare_dir(ours, None)  # a leftover of ours: replaced
    assert sorted(p.name for p in again.iterdir()) == [integrity.OWNED]


def test_rng_round_trip(tmp_path):
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    rng.save(tmp_path, 0)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(9)
    random.seed(9)
    np.random.seed(9)
    assert rng.load(tmp_path, 0) == []
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1] and np.random.rand() == expected[2]
    assert "no random state for rank 1" in rng.load(tmp_path, 1)[0]
    (tmp_path / rng.file_name(0)).write_text("[]")
    assert "unusable" in rng.load(tmp_path, 0)[0]


def test_rng_file_follows_no_planted_symlink(tmp_path):
    """Round 3, item 8: a symlink planted at ``rng_rank0.json`` in the claimed directory (by
    whoever can write the storage) is replaced, never written through."""
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = sharded.prepare_dir(tmp_path / "checkpoint_00000001", None)
    (path / rng.file_name(0)).symlink_to(victim)
    sharded.save(path, _model())
    assert victim.read_text() == "keep"
    assert not (path / rng.file_name(0)).is_symlink()
    assert json.loads((path / rng.file_name(0)).read_text())["format"] == rng.FORMAT


def test_download_names_an_object_gone_mid_copy(good, tmp_path, monkeypatch):
    """Round 3, item 8: an object listed, then deleted before it is copied (a run rotating
    checkpoints out) is a CheckpointError naming it and what to do, not a FileNotFoundError.
    Real pyarrow copy, from a filesystem that deletes one shard right after listing."""
    import pyarrow.fs as pafs

    from ray_mesh.checkpointing import remote
    from ray_mesh.core import object_store

    src = _copy(good, tmp_path, 6)
    gone = src / "__0_0.distcp"
    local = pafs.LocalFileSystem()

    class Rotating(pafs.FileSystemHandler):
        def __eq__(self, other): return isinstance(other, Rotating)
        def __ne__(self, other): return not self == other
        def get_type_name(self): return "rotating"
        def normalize_path(self, p): return p
        def get_file_info(self, paths): return local.get_file_info(paths)
        def open_input_stream(self, p): return local.open_input_stream(p)
        def open_input_file(self, p): return local.open_input_file(p)

        def get_file_info_selector(self, selector):
            listed = local.get_file_info(selector)
            gone.unlink()
            return listed

        def _unused(self, *args, **kwargs): raise AssertionError("download only reads")
        create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _unused
        delete_file = move = copy_file = open_output_stream = open_append_stream = _unused

    monkeypatch.setattr(object_store, "filesystem",
                        lambda path, endpoint=None: (pafs.PyFileSystem(Rotating()), str(src)))
    uri = "s3://bucket/run/checkpoint_00000006"
    with pytest.raises(sharded.CheckpointError, match=rf"{uri} changed while it was being "
                                                      rf"copied: .*__0_0\.distcp was listed "
                                                      rf"but is gone.*newer checkpoint"):
        remote.download(uri, tmp_path / "copy")


@pytest.mark.parametrize("payload", [
    b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93.",
    b"cbuiltins\neval\n.",
    b"ctorch.distributed.checkpoint.metadata\nEnum\n.",  # imported there, not defined there
    b"ctorch\nload\n.",
])
def test_restricted_unpickler_refuses_other_globals(tmp_path, payload):
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(ValueError, match="not DCP metadata"):
        integrity.read_metadata(tmp_path)
