"""A heal from every group holding the newest step: which donor sends which entry
(``link.state_sources``) and which entries may come from any of them
(``state.shared_entries``). The transfer itself, over gloo: tests/dist/test_link_store.py."""

from __future__ import annotations

import pytest
import torch

from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.parallel.diloco import DiLoCo
from ray_mesh.replicas.link import state_sources
from ray_mesh.replicas.state import materialize, shared_entries, tensors_and_likes

pytestmark = pytest.mark.unit


def test_one_donor_sends_everything():
    assert state_sources([8, 4, 2], [True, False, True], 1) == [0, 0, 0]
    assert state_sources([], [], 3) == []


@pytest.mark.parametrize("donors", [2, 3, 5])
def test_shared_entries_spread_evenly_and_the_others_come_from_the_first(donors):
    sizes = [400, 300, 300, 200, 100, 100, 64, 8, 8, 4]
    shared = [True] * 9 + [False]  # the last: this donor's own (say, a counter of its own)
    part = state_sources(sizes, shared, donors)
    assert part[-1] == 0 and set(part) == set(range(donors))
    loads = [sum(n for n, k in zip(sizes, part, strict=True) if k == j) for j in range(donors)]
    # largest first to the least loaded: no donor carries more than its share plus one entry
    assert max(loads) <= sum(sizes) / donors + max(sizes), loads
    assert part == state_sources(sizes, shared, donors)  # the same on every member


def test_a_donors_own_entries_load_it_first():
    # donor 0 sends the unshared 500 bytes; the shared ones go to the others first
    assert state_sources([500, 200, 200], [False, True, True], 2) == [0, 1, 1]


def _model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    materialize(optim)
    return model, optim


def test_sync_groups_share_parameters_and_optimizer_state_not_buffers():
    model, optim = _model_and_adam()
    counters = torch.zeros(3, dtype=torch.int64)
    tensors, _ = tensors_and_likes(model, optim, None, counters)
    shared = shared_entries(model, optim, None, counters)
    assert len(shared) == len(tensors)
    n_params, n_buffers = len(list(model.parameters())), len(list(model.buffers()))
    assert shared[:n_params] == [True] * n_params
    assert shared[n_params:n_params + n_buffers] == [False] * n_buffers  # BatchNorm's own
    assert all(shared[n_params + n_buffers:])  # Adam's state, the counters


def test_diloco_groups_share_only_the_outer_state_and_the_counters():
    model, optim = _model_and_adam()
    diloco = DiLoCo(model, None, DiLoCoConfig(every=4))
    counters = torch.zeros(3, dtype=torch.int64)
    tensors, _ = tensors_and_likes(model, optim, diloco, counters)
    shared = shared_entries(model, optim, diloco, counters)
    assert len(shared) == len(tensors)
    outer = len(diloco.global_params) + len(diloco.momentum)
    assert shared[-outer - 1:] == [True] * (outer + 1)
    assert not any(shared[:-outer - 1])  # its round's parameters, its inner optimizer
