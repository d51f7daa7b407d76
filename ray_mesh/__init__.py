"""ray_mesh: named DeviceMesh training (pp, dp_replicate, dp_shard, cp, tp) on a Ray cluster."""

from typing import TYPE_CHECKING

from ray_mesh.core.layout import Layout, parse_layout
from ray_mesh.core.object_store import run_storage
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS, MeshSpec
from ray_mesh.errors import MeshSpecError, RayMeshError

if TYPE_CHECKING:  # what type checkers, editors and the API reference see
    from ray_mesh.core.bootstrap import (
        get_mesh,
        get_state,
        init_mesh,
        is_initialized,
        shutdown_mesh,
    )

__all__ = [
    "Checkpointer",
    "DIM_NAMES",
    "FLATTENED_DIMS",
    "Layout",
    "MeshConfig",
    "MeshDataConfig",
    "MeshSpec",
    "MeshSpecError",
    "RayMeshError",
    "check_cluster",
    "check_storage",
    "get_mesh",
    "get_state",
    "init_mesh",
    "is_initialized",
    "parse_layout",
    "parallel",
    "run_storage",
    "shutdown_mesh",
]


_BOOTSTRAP = ("get_mesh", "get_state", "init_mesh", "is_initialized", "shutdown_mesh")


def __getattr__(name: str):
    # The worker bootstrap imports torch (~1 s of CPU): loaded on first use, so that
    # `import ray_mesh` and the CLI's commands that never build a mesh (status, storage, plan,
    # a job refused on the driver) start without it (tests/unit/test_architecture.py).
    if name in _BOOTSTRAP:
        from ray_mesh.core import bootstrap

        return getattr(bootstrap, name)
    # MeshConfig imports Ray; keep `import ray_mesh` Ray-free for torchrun users.
    if name == "MeshConfig":
        from ray_mesh.raytrain.backend import MeshConfig

        return MeshConfig
    if name == "MeshDataConfig":
        from ray_mesh.raytrain.data import MeshDataConfig

        return MeshDataConfig
    if name == "check_cluster":
        from ray_mesh.raytrain.launch import check_cluster

        return check_cluster
    if name in ("Checkpointer", "check_storage"):  # Ray imports: lazy as well
        from ray_mesh import checkpointing

        return getattr(checkpointing, name)
    if name == "parallel":  # TP/FSDP/PP helpers: torch-only, loaded on first use
        import importlib

        return importlib.import_module("ray_mesh.parallel")
    raise AttributeError(f"module 'ray_mesh' has no attribute {name!r}")
