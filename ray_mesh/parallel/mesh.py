"""Mesh access for the parallel helpers: look up a dim, the rank's device, divisors for a hint.

Every helper in ``ray_mesh.parallel`` takes the full ray_mesh mesh, or the worker's
:class:`~ray_mesh.MeshState` (``ray_mesh.get_state()``: the mesh with its layout, the context
to pass), and picks its own dims.
Looking a dim up goes through :func:`submesh`, so a mesh without that dim (a hand-built
``init_device_mesh``, a 1-D slice passed by mistake) fails the same way everywhere: a
:class:`~ray_mesh.errors.ParallelError` naming the dim, the dims the mesh has, and
how to get a mesh that has it.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from ray_mesh.core import bootstrap
from ray_mesh.core.bootstrap import MeshState
from ray_mesh.errors import ParallelError

GET_MESH_HINT = ("Use the mesh from ray_mesh.get_mesh() (Ray Train, MeshConfig) or "
                 "ray_mesh.init_mesh() (torchrun), which has every ray_mesh dim.")


MeshOrState = DeviceMesh | MeshState
"""What the helpers take: a mesh, or the worker's state (its mesh and its layout)."""


def mesh_of(where: MeshOrState) -> DeviceMesh:
    """The mesh of ``where`` (a mesh as is, a state's mesh)."""
    return where.mesh if isinstance(where, MeshState) else where


def submesh(mesh: MeshOrState, *names: str, hint: str = GET_MESH_HINT) -> DeviceMesh:
    """``mesh[names]`` for named or flattened dims, or a ParallelError naming the fix.

    Through :func:`ray_mesh.core.bootstrap.submesh`, which hands out the flattened dims
    (``dp``, ``dp_shard_cp``, ``dp_cp``) the mesh kept when it was built instead of slicing
    them from the root (deprecated in torch). They are not in ``mesh_dim_names``, so the
    lookup itself is the test; torch raises KeyError, RuntimeError or ValueError depending on
    the version and on whether the name is unknown or the mesh is not a root mesh.

    Stability: stable
    """
    mesh = mesh_of(mesh)
    try:
        return bootstrap.submesh(mesh, *names)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ParallelError(
            f"The mesh has no {' x '.join(map(repr, names))} dim (dims: "
            f"{mesh.mesh_dim_names}). {hint}"
        ) from exc


def dim_size(mesh: MeshOrState, name: str, default: int | None = None) -> int:
    """The size of dim ``name``; ``default`` when the mesh lacks it (an error if None).

    Stability: stable
    """
    mesh = mesh_of(mesh)
    if default is not None and name not in (mesh.mesh_dim_names or ()):
        return default
    return submesh(mesh, name).size()


def mesh_device(mesh: MeshOrState) -> torch.device:
    """The device this rank computes on for ``mesh``: the current CUDA device, or the CPU.

    Stability: stable
    """
    mesh = mesh_of(mesh)
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def divisors(n: int) -> str:
    """``"1, 2, 3, 6"`` for 6: the sizes to suggest when ``n`` must be split evenly."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


__all__ = ["dim_size", "mesh_device", "submesh"]
