"""Exact data positions and the dp split, as plain logic (no Ray instance, no process group).

The Ray side (real streaming splits, a SIGKILLed worker) is tests/ray/test_mesh_data_ray.py.
"""

from __future__ import annotations

import pytest
from ray.train import DataConfig
from torch.utils.data import DistributedSampler

from ray_mesh.core.spec import MeshSpec
from ray_mesh.parallel import ParallelError, ResumableSampler
from ray_mesh.raytrain.data import (
    DataSplitError,
    MeshDataConfig,
    ResumableShard,
    mesh_data_config,
    split_ranks,
)


@pytest.mark.parametrize("n,dp,shuffle,drop_last", [
    (48, 2, True, False), (50, 4, True, False), (50, 4, False, True), (7, 3, True, False)])
def test_same_order_as_distributed_sampler(n, dp, shuffle, drop_last):
    for epoch in (0, 1):
        for rank in range(dp):
            ref = DistributedSampler(range(n), num_replicas=dp, rank=rank, shuffle=shuffle,
                                     seed=5, drop_last=drop_last)
            ref.set_epoch(epoch)
            ours = ResumableSampler(n, dp, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref)


def _consume(n: int, dp: int, k: int, position=None, epoch: int = 0) -> tuple[list, dict]:
    """k samples on each of dp ranks (all of the epoch's rest when k is None)."""
    read, pos = [], None
    for rank in range(dp):
        s = ResumableSampler(n, dp, rank, seed=1, position=position)
        s.set_epoch(epoch)
        got = list(s)[:k]
        s.advance(len(got))
        read += got
        pos = s.position() if pos is None else pos
        assert s.position() == pos  # the same on every rank
    return read, pos


@pytest.mark.parametrize("dp_before,dp_after", [(2, 2), (2, 3), (4, 2), (3, 4)])
def test_resume_reads_the_rest_of_the_epoch_once(dp_before, dp_after):
    n = 60
    before, pos = _consume(n, dp_before, 5)
    assert pos == {"epoch": 0, "consumed": 5 * dp_before}
    after, end = _consume(n, dp_after, None, position=pos)
    # none repeated, none skipped; like DistributedSampler, the rest is padded (by repeating
    # its own start) to a multiple of the new dp size
    assert set(before).isdisjoint(after) and set(before + after) == set(range(n))
    pad = -(n - len(before)) % dp_after
    assert len(before) + len(after) == n + pad
    assert end["consumed"] == n + pad
    # the next epoch starts from its beginning, in its own order
    nxt, _ = _consume(n, dp_after, None, position=pos, epoch=1)
    assert sorted(nxt) == list(range(n))


def test_same_dp_resume_equals_uninterrupted_per_rank():
    n, dp = 40, 4
    for rank in range(dp):
        whole = list(ResumableSampler(n, dp, rank, seed=9))
        first = ResumableSampler(n, dp, rank, seed=9)
        head = list(first)[:3]
        first.advance(3)
        rest = list(ResumableSampler(n, dp, rank, seed=9, position=first.position()))
        assert head + rest == whole


def test_end_of_epoch_and_bad_positions():
    s = ResumableSampler(10, 2, 0, position={"epoch": 3, "consumed": 10})
    s.set_epoch(3)
    assert list(s) == [] and len(s) == 0
    with pytest.raises(ParallelError, match="'epoch' and 'consumed'"):
        ResumableSampler(10, 2, 0, position={"step": 3})
    with pytest.raises(ParallelError, match="dp size and dp rank"):
        ResumableSampler(10, 2, 2)


def test_split_ranks_peers_share_dp_index():
    spec = MeshSpec(dp_shard=2, tp=2).resolve(4)
    assert split_ranks(spec) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    spec = MeshSpec(pp=2, dp_shard=2, tp=2).resolve(8)
    pairs = split_ranks(spec)
    assert sorted(pairs) == [(d, j) for d in range(2) for j in range(4)]
    for rank, (d, _) in enumerate(pairs):
        assert d == spec.coordinate(rank)["dp"]


def test_which_data_config_a_mesh_run_uses():
    spec = MeshSpec(dp_shard=2, tp=2).resolve(4)
    plain = DataConfig(datasets_to_split=["train"], enable_shard_locality=False)
    made = mesh_data_config(plain, spec)
    assert isinstance(made, MeshDataConfig) and made.mesh == spec
    assert made._datasets_to_split == ["train"] and made._enable_shard_locality is False
    explicit = MeshDataConfig()
    assert mesh_data_config(explicit, spec).mesh == spec and explicit.mesh is None

    class Custom(DataConfig):
        pass

    with pytest.raises(DataSplitError, match="MeshDataConfig") as err:
        mesh_data_config(Custom(), spec)
    assert "2 tp/cp/pp peers" in str(err.value)
    dp_only = MeshSpec(dp_shard=4).resolve(4)
    custom = Custom()
    assert mesh_data_config(custom, dp_only) is custom  # world rank == dp rank: fine
    with pytest.raises(DataSplitError, match="differs from the run's mesh"):
        mesh_data_config(MeshDataConfig(mesh={"dp_shard": 4, "tp": 1}), spec)
    with pytest.raises(DataSplitError, match="has no mesh"):
        MeshDataConfig().configure({}, 4, None, None)


class _Batches:
    """A stand-in for a DataIterator's batch stream: only the counting is under test here."""

    def __init__(self, rows: int, batch: int) -> None:
        self.rows, self.batch = rows, batch

    def iter_batches(self, batch_size: int):
        assert batch_size == self.batch
        for i in range(0, self.rows, batch_size):
            yield {"id": list(range(i, min(i + batch_size, self.rows)))}


def test_resumable_shard_skips_exactly_and_moves_to_the_next_epoch():
    it = _Batches(10, 3)
    shard = ResumableShard(it, dp_size=2)
    seen = []
    for b in shard.iter_batches(batch_size=3):
        seen.append(b["id"])
        if len(seen) == 2:
            break
    pos = shard.position()
    assert pos == {"epoch": 0, "batches": 2, "rows": 6, "dp_size": 2}
    resumed = ResumableShard(it, pos, dp_size=2)
    assert [b["id"] for b in resumed.iter_batches(batch_size=3)] == [[6, 7, 8], [9]]
    assert resumed.position() == {"epoch": 1, "batches": 0, "rows": 0, "dp_size": 2}
    assert len(list(resumed.iter_batches(batch_size=3))) == 4 and resumed.epoch == 1
    with pytest.raises(DataSplitError, match="batch size of the run that saved"):
        list(ResumableShard(_Batches(10, 4), pos, dp_size=2).iter_batches(batch_size=4))
    # saved on dp=2, resumed on dp=4: the same fraction (3 of 10 rows here), with a warning
    other = ResumableShard(_Batches(10, 3), pos, dp_size=4)
    assert [b["id"] for b in other.iter_batches(batch_size=3)] == [[3, 4, 5], [6, 7, 8], [9]]
