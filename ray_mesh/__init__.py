"""ray_mesh: named DeviceMesh training (pp, dp_replicate, dp_shard, cp, tp) on a Ray cluster.

The public API is this package, :mod:`ray_mesh.parallel`, :mod:`ray_mesh.checkpointing` and
:mod:`ray_mesh.replicas`: the names in their ``__all__``, each marked ``Stability: stable`` or
``Stability: experimental`` in its docstring (``docs/api/index.md``). Every other module is
internal. ``import ray_mesh`` loads neither torch nor Ray: the names that need them are
imported on first use.
"""

from typing import TYPE_CHECKING

from ray_mesh.core import deprecation as _deprecation
from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.core.layout import Layout, parse_layout
from ray_mesh.core.object_store import run_storage
from ray_mesh.core.options import MeshOptions
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS, MeshSpec
from ray_mesh.errors import (
    ClusterError,
    CollectiveHangError,
    ConfigurationError,
    MeshSpecError,
    PreflightError,
    RayMeshError,
    UserInputError,
)

if TYPE_CHECKING:  # what type checkers, editors and the API reference see
    from ray_mesh import parallel
    from ray_mesh.checkpointing.storage import check_storage
    from ray_mesh.checkpointing.train import Checkpointer
    from ray_mesh.core.bootstrap import (
        MeshState,
        get_mesh,
        get_state,
        init_mesh,
        is_initialized,
        shutdown_mesh,
    )
    from ray_mesh.observability.dim_probe import probe_dims
    from ray_mesh.observability.owner import watch_mesh
    from ray_mesh.observability.report import report, report_due, report_progress
    from ray_mesh.planning.inputs import PlanInputs
    from ray_mesh.raytrain.backend import MeshConfig
    from ray_mesh.raytrain.data import MeshDataConfig, ResumableShard
    from ray_mesh.raytrain.launch import check_cluster
    from ray_mesh.raytrain.replica_groups import fit_replica_groups, replica_group

__all__ = [
    "Checkpointer",
    "ClusterError",
    "CollectiveHangError",
    "ConfigurationError",
    "DIM_NAMES",
    "DiLoCoConfig",
    "FLATTENED_DIMS",
    "Layout",
    "MeshConfig",
    "MeshDataConfig",
    "MeshOptions",
    "MeshSpec",
    "MeshSpecError",
    "MeshState",
    "PlanInputs",
    "PreflightError",
    "RayMeshError",
    "ResumableShard",
    "UserInputError",
    "check_cluster",
    "check_storage",
    "fit_replica_groups",
    "get_mesh",
    "get_state",
    "init_mesh",
    "is_initialized",
    "parallel",
    "parse_layout",
    "probe_dims",
    "replica_group",
    "report",
    "report_due",
    "report_progress",
    "run_storage",
    "shutdown_mesh",
    "watch_mesh",
]

# name -> (module, attribute), imported on first use (PEP 562). The worker bootstrap and the
# metrics helpers import torch (~1 s of CPU), the Ray Train glue imports Ray: loaded lazily,
# `import ray_mesh` and the CLI's commands that never build a mesh (status, storage, plan, a
# job refused on the driver) start without them (tests/unit/test_architecture.py), and
# torchrun users never load Ray.
_LAZY: dict[str, tuple[str, str]] = {
    "MeshState": ("ray_mesh.core.bootstrap", "MeshState"),
    "get_mesh": ("ray_mesh.core.bootstrap", "get_mesh"),
    "get_state": ("ray_mesh.core.bootstrap", "get_state"),
    "init_mesh": ("ray_mesh.core.bootstrap", "init_mesh"),
    "is_initialized": ("ray_mesh.core.bootstrap", "is_initialized"),
    "shutdown_mesh": ("ray_mesh.core.bootstrap", "shutdown_mesh"),
    "MeshConfig": ("ray_mesh.raytrain.backend", "MeshConfig"),
    "MeshDataConfig": ("ray_mesh.raytrain.data", "MeshDataConfig"),
    "ResumableShard": ("ray_mesh.raytrain.data", "ResumableShard"),
    "check_cluster": ("ray_mesh.raytrain.launch", "check_cluster"),
    "fit_replica_groups": ("ray_mesh.raytrain.replica_groups", "fit_replica_groups"),
    "replica_group": ("ray_mesh.raytrain.replica_groups", "replica_group"),
    "Checkpointer": ("ray_mesh.checkpointing.train", "Checkpointer"),
    "check_storage": ("ray_mesh.checkpointing.storage", "check_storage"),
    "PlanInputs": ("ray_mesh.planning.inputs", "PlanInputs"),
    "probe_dims": ("ray_mesh.observability.dim_probe", "probe_dims"),
    "watch_mesh": ("ray_mesh.observability.owner", "watch_mesh"),
    "report": ("ray_mesh.observability.report", "report"),
    "report_due": ("ray_mesh.observability.report", "report_due"),
    "report_progress": ("ray_mesh.observability.report", "report_progress"),
    "parallel": ("ray_mesh.parallel", ""),  # TP/FSDP/PP helpers: the subpackage itself
}

DEPRECATED: dict[str, _deprecation.Deprecated] = {}
"""Deprecated public names of this package (``ray_mesh.core.deprecation``): none."""


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        return _deprecation.resolve(__name__, name, DEPRECATED)
    import importlib

    module = importlib.import_module(where[0])
    return getattr(module, where[1]) if where[1] else module


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
