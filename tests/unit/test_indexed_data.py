"""Samples by index (ray_mesh.data.indexed): sample ``i`` is one fixed sequence of the job's
``data:`` wherever and however often it is built, indices wrap epoch after epoch, the
validation files stay out, and bad input is refused with the fix. Ray-free."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ray_mesh.data.indexed import (
    LocalRows,
    TokenSamples,
    epoch_order,
    group_samples,
    manifest,
    train_files,
)
from ray_mesh.data.indexed_ray import BlockRows
from ray_mesh.data.spec import DataSpec
from ray_mesh.data.text import SEPARATOR
from ray_mesh.errors import DataSpecError


def _corpus(root: Path, n: int = 12, size: int = 300) -> Path:
    """``n`` text files; file k holds only the byte ``ord('A') + k`` (its marker)."""
    data = root / "corpus" / "texts"
    data.mkdir(parents=True)
    for k in range(n):
        (data / f"doc{k:02d}.txt").write_bytes(bytes([65 + k]) * (size + 7 * k))
    return data


def _spec(data: Path, **kw) -> DataSpec:
    return DataSpec.from_dict({"paths": [str(data)], "seq_len": 15, "validation": 0.25,
                               "shuffle_seed": 3, **kw})


def test_two_independent_constructions_give_the_same_samples_also_from_another_root(tmp_path):
    data = _corpus(tmp_path / "node_a")
    other = tmp_path / "node_b" / "elsewhere"
    shutil.copytree(data.parent, other / "corpus")  # same names and sizes, another root
    a = TokenSamples.from_spec(_spec(data))
    b = TokenSamples.from_spec(_spec(data))
    c = TokenSamples.from_spec(_spec(other / "corpus" / "texts"), expect=a.fingerprint)
    ids = list(range(0, 3 * len(a) + 5, 7))
    assert torch.equal(a.batch(ids), b.batch(ids)) and torch.equal(a.batch(ids), c.batch(ids))
    assert a.fingerprint == c.fingerprint == manifest(_spec(data))
    assert a[5].shape == (16,) and a[5].dtype == torch.int64 and torch.equal(a[5], c[5])


def test_a_sample_is_a_row_of_the_token_stream_of_the_files_in_their_seeded_order(tmp_path):
    spec = _spec(_corpus(tmp_path))
    samples = TokenSamples.from_spec(spec)
    stream = b"".join(p.read_bytes() + bytes([SEPARATOR]) for p in train_files(spec))
    table = np.frombuffer(stream, np.uint8)[: len(samples) * 16].reshape(-1, 16)
    rows = samples.row_of(range(len(samples)))
    assert sorted(rows.tolist()) == list(range(len(samples)))  # epoch 0: every row once
    assert torch.equal(samples.batch(list(range(len(samples)))),
                       torch.from_numpy(table[rows].astype(np.int64)))
    assert len(samples) == len(stream) // 16 and samples.seq_len == 15
    assert [p.name for p in train_files(spec)] != sorted(p.name for p in train_files(spec))


def test_indices_past_the_end_wrap_to_the_next_epoch_in_a_new_order(tmp_path):
    samples = TokenSamples.from_spec(_spec(_corpus(tmp_path)))
    n = len(samples)
    for epoch in (1, 2, 7):
        rows = samples.row_of(range(epoch * n, (epoch + 1) * n))
        assert sorted(rows.tolist()) == list(range(n))  # each epoch: every row once
        assert rows.tolist() != samples.row_of(range(n)).tolist()  # in another order
    # a batch across an epoch's end, and the same index asked again later: the same rows
    ids = list(range(n - 3, n + 3))
    first = samples.batch(ids)
    samples.batch(list(range(5 * n, 5 * n + 4)))  # other epochs in between
    assert torch.equal(samples.batch(ids), first)
    # the order comes from hashing, not a random generator's stream: pinned
    assert epoch_order(6, 0, 0).tolist() == EPOCH_ORDER_6_0_0


EPOCH_ORDER_6_0_0 = [1, 4, 5, 0, 3, 2]


def test_validation_files_are_held_out(tmp_path):
    data = _corpus(tmp_path)
    for validation in (0.25, [str(data / "doc0[0-2].txt")]):
        spec = _spec(data, validation=validation)
        train, val = spec.split()
        held = {p.read_bytes()[0] for p in val}
        assert held and len(train) + len(val) == 12
        samples = TokenSamples.from_spec(spec)
        seen = set(np.unique(samples.batch(list(range(len(samples)))).numpy()).tolist())
        assert not seen & held, (seen, held)
        assert seen - {SEPARATOR} == {p.read_bytes()[0] for p in train}


def test_max_tokens_caps_the_rows_and_the_manifest_names_only_the_files_read(tmp_path):
    data = _corpus(tmp_path)
    full, capped = _spec(data), _spec(data, max_tokens=700)
    assert len(TokenSamples.from_spec(capped)) == 700 // 16
    assert manifest(full) != manifest(capped)
    # a file past the cap changes size: the samples the cap reads do not change
    order = train_files(capped)
    order[-1].write_bytes(order[-1].read_bytes() + b"more")
    assert manifest(capped) == TokenSamples.from_spec(capped).fingerprint


def test_the_stdlib_reads_by_index_the_same_twice():
    spec = DataSpec.from_dict({"paths": ["stdlib"], "seq_len": 32, "max_tokens": 100_000})
    a, b = TokenSamples.from_spec(spec), TokenSamples.from_spec(spec, expect=manifest(spec))
    assert len(a) == 100_000 // 33 and torch.equal(a.batch([0, 1, 5000]), b.batch([0, 1, 5000]))


class _Fetch:
    """Stands in for ``ray.get`` of the blocks' refs (here: their positions)."""

    def __init__(self, blocks: list[np.ndarray]) -> None:
        self.blocks, self.calls = blocks, []

    def __call__(self, refs: list[int]) -> list[np.ndarray]:
        self.calls.append(refs)
        return [self.blocks[r] for r in refs]


def test_rows_in_blocks_read_like_rows_in_memory_and_pickle_without_their_data():
    table = np.arange(40 * 5, dtype=np.uint8).reshape(40, 5)
    fetch = _Fetch([table[:7], table[7:25], table[25:]])
    local = TokenSamples(LocalRows(table), shuffle_seed=1)
    stored = TokenSamples(BlockRows([0, 1, 2], [7, 18, 15], 5, fetch), shuffle_seed=1)
    ids = list(range(0, 95, 3))
    assert torch.equal(local.batch(ids), stored.batch(ids))
    assert sorted(r for call in fetch.calls for r in call) == [0, 1, 2]  # each block once
    stored.batch(ids)
    assert len(fetch.calls) == 1
    again = pickle.loads(pickle.dumps(stored.rows))
    assert again._got == {} and again.blocks == [0, 1, 2]
    assert torch.equal(TokenSamples(again, shuffle_seed=1).batch(ids), local.batch(ids))


def test_bad_input_is_refused_with_the_fix(tmp_path):
    data = _corpus(tmp_path)
    samples = TokenSamples.from_spec(_spec(data))
    for bad, why in ((-1, "indices count up from 0"), (2.0, "a whole number >= 0"),
                     (True, "a whole number >= 0"), (2**63, "out of range")):
        with pytest.raises(IndexError, match=why):
            samples.batch([bad])
    with pytest.raises(DataSpecError, match=r"differ from the driver's.*same files on every "
                                            r"node.*data_from: ray_data"):
        TokenSamples.from_spec(_spec(data), expect="0123456789abcdef")
    with pytest.raises(DataSpecError, match=r"no row of 16 tokens.*lower seq_len"):
        TokenSamples.from_spec(_spec(data, max_tokens=10))
    with pytest.raises(DataSpecError, match=r"config has none.*Add a data: section"):
        group_samples({"steps": 3})
    with pytest.raises(DataSpecError, match=r"2-D array of at least 2 tokens"):
        LocalRows(np.zeros(5, np.uint8))
    with pytest.raises(DataSpecError, match=r"must match and not be empty"):
        BlockRows([], [], 5)


def test_group_samples_reads_the_section_ray_mesh_run_passes(tmp_path):
    spec = _spec(_corpus(tmp_path))
    config = {"data": spec.to_dict(), "data_index": {"manifest": manifest(spec)}}
    assert torch.equal(group_samples(config).batch([0, 9]),
                       TokenSamples.from_spec(spec).batch([0, 9]))
    given = TokenSamples(LocalRows(np.ones((3, 4), np.uint8)))
    assert group_samples({"data_index": {"samples": given}}) is given
