"""Flattened dims handed out from the meshes ``_flatten`` returned: no torch deprecation
warning (torch 2.11+ warns when a flattened dim is sliced from the root mesh). One process
with torch's fake process group: the layout is what is checked, not communication."""

from __future__ import annotations

import warnings

import pytest


def test_flattened_dims_come_from_kept_meshes_without_deprecation():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ray_mesh.core.bootstrap import build_device_mesh, submesh
    from ray_mesh.core.spec import MeshSpec

    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = build_device_mesh(MeshSpec(dp_replicate=2, dp_shard=2, tp=2), "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "Slicing a flattened dim" is a warning
            dp = submesh(mesh, "dp")
            hsdp = submesh(mesh, "dp_replicate", "dp_shard_cp")
            tp = submesh(mesh, "tp")
        assert dp.mesh.tolist() == [0, 2, 4, 6]
        assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        assert hsdp.mesh.tolist() == [[0, 2], [4, 6]]
        assert tp.mesh.tolist() == [0, 1]
        with pytest.warns(UserWarning, match="flattened dim"):  # what submesh avoids
            assert mesh["dp"].mesh.tolist() == dp.mesh.tolist()
    finally:
        dist.destroy_process_group()
