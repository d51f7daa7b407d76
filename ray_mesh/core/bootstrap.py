"""Ray-free worker bootstrap: environment -> process group -> DeviceMesh -> get_mesh().

This module imports torch, never Ray, so the same bring-up runs under ``torchrun``
(:func:`init_mesh` reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and inside Ray
Train workers (the backend calls :func:`setup_worker`).

The mesh lives in a module global because Ray Train V2 runs the train function in another
thread of the worker process than the one that built the mesh; the CUDA device, which is
per thread, is set again for the training thread by :func:`use_device`.

The run's :class:`~ray_mesh.core.layout.Layout` (reduce dtype, pipeline, replicate mode) is
held by the mesh it was built for (:func:`mesh_layout`) and by :class:`MeshState`, and by
nothing else: the parallel helpers read it off the mesh they are given, so a mesh built for
a trial carries the trial's layout and the run's mesh the run's, whatever ran before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import ray_mesh.private_apis as private_apis
from ray_mesh.core import rendezvous_store, teardown
from ray_mesh.core.devices import default_backend, pick_device, use_device
from ray_mesh.core.layout import Layout, parse_layout
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS, MeshSpec
from ray_mesh.errors import BootstrapError

logger = logging.getLogger(__name__)

DEFAULT_PG_TIMEOUT_S = 600.0


@dataclass
class MeshState:
    """What this process knows about its place in the mesh, and the context to pass on:
    every ``ray_mesh.parallel`` helper that takes a mesh takes this too, and follows its
    ``layout`` (``parallelize(model, ray_mesh.get_state())``).

    Stability: stable
    """

    mesh: DeviceMesh
    spec: MeshSpec
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    env: dict[str, str] = field(default_factory=dict)
    layout: Layout = field(default_factory=Layout)  # the run's layout, dims = spec
    picked: str = ""  # why mesh="auto" picked the layout ("" for a fixed mesh)

    @property
    def coordinate(self) -> dict[str, int]:
        return self.spec.coordinate(self.rank)


_state: MeshState | None = None
_lock = threading.Lock()


def get_mesh() -> DeviceMesh:
    """The DeviceMesh of this worker, with every named dim and the flattened dp dims.

    Stability: stable
    """
    return get_state().mesh


def get_state() -> MeshState:
    """This worker's :class:`MeshState`: the mesh with its spec, device, backend and layout.

    Raises a :class:`~ray_mesh.ClusterError` (``BootstrapError``) before a mesh exists in
    this process.

    Stability: stable
    """
    if _state is None:
        raise BootstrapError(
            "ray_mesh.get_mesh() was called before a mesh exists in this process. Under Ray "
            "Train pass torch_config=ray_mesh.MeshConfig(mesh=...) to TorchTrainer; under "
            "torchrun call ray_mesh.init_mesh(spec) first."
        )
    return _state


def is_initialized() -> bool:
    """Whether this process has a mesh (built by ``MeshConfig`` or :func:`init_mesh`).

    Stability: stable
    """
    return _state is not None


# --------------------------------------------------------------------------- mesh
REAL_SIZE1_GROUPS_ENV = "RAY_MESH_REAL_SIZE1_GROUPS"
"""Set to 1 to give every dim a real communicator of its own: size-1 dims and flattened
dims that repeat another dim's groups included (by default they share a group or use
torch's fake backend)."""


def _fake_backend_available() -> bool:
    """Register torch's "fake" process-group backend, the one DeviceMesh uses for disabled dims.

    False if this torch lacks it (see ``private_apis.register_fake_pg_backend``).
    """
    return private_apis.register_fake_pg_backend()


def _sharing_enabled(real_size1_groups: bool | None) -> bool:
    """False when the user asked for a real group per dim, or torch lacks the fake backend."""
    if real_size1_groups is None:
        real_size1_groups = os.environ.get(REAL_SIZE1_GROUPS_ENV, "") not in ("", "0")
    return not real_size1_groups and _fake_backend_available()


def twin_dims(spec: MeshSpec) -> dict[str, str]:
    """``{flattened dim: earlier dim with exactly the same groups}``, for sharing a group.

    A flattened dim whose parts are all size 1 but one has that part's groups (``dp_shard_cp``
    is ``dp_shard`` when cp=1); two flattened dims with the same parts of size > 1 have the
    same groups (``dp_cp`` is ``dp`` when cp=1). Dims of size 1 (fake groups) and dims that
    span the world (torch reuses the default group) need no twin.
    """
    world = spec.world_size
    twins: dict[str, str] = {}
    seen: dict[tuple[str, ...], str] = {}
    for flat, parts in FLATTENED_DIMS.items():
        if spec.size(flat) in (1, world):
            continue
        big = tuple(p for p in parts if spec.size(p) > 1)
        if len(big) == 1:
            twins[flat] = big[0]
        elif big in seen:
            twins[flat] = seen[big]
        else:
            seen[big] = flat
    return twins


def _share_group(flat_mesh: DeviceMesh, twin_group: dist.ProcessGroup, flat: str) -> None:
    """Point a flattened dim built on a fake group at its twin's real group.

    torch has no public call that registers an existing group as a flattened dim
    (``private_apis.set_mesh_group``). The ranks are checked against the mesh's own layout.
    """
    want = flat_mesh.mesh.flatten().tolist()
    got = dist.get_process_group_ranks(twin_group)
    if want != got:
        raise BootstrapError(
            f"ray_mesh bug: flattened dim {flat!r} has ranks {want} but its twin group has "
            f"{got}. Set {REAL_SIZE1_GROUPS_ENV}=1 to give every dim its own group, and "
            f"please report this with the mesh shape.")
    private_apis.set_mesh_group(flat_mesh, twin_group)


def build_device_mesh(spec: MeshSpec, device_type: str, *, layout: Layout | None = None,
                      real_size1_groups: bool | None = None) -> DeviceMesh:
    """A DeviceMesh with all five named dims (size 1 included) and the flattened dims.

    Every dim answers by name (``mesh["tp"]``, ``mesh.get_group("cp")``) whatever its size,
    so training code need not branch on the layout. A dim of size 1 gets torch's "fake"
    process group instead of a real communicator: on CPU/gloo a real one costs a gloo
    context and worker threads per rank, and on GPUs a one-rank NCCL communicator split off
    the world. On a one-rank group every collective is the identity or a copy, which the
    fake group does (checked in tests/test_mesh_size1.py: all_reduce, all_gather,
    reduce_scatter, broadcast, object collectives, FSDP2 HSDP with dp_replicate=1). What
    differs: ``dist.get_backend(group)`` says "fake", and NCCL's ``ReduceOp.PREMUL_SUM``
    scale is not applied on a size-1 dim.

    A flattened dim with exactly the groups of an earlier dim (:func:`twin_dims`: with
    cp=1, ``dp_shard_cp`` is ``dp_shard``) shares that dim's process group rather than
    holding a second communicator with the same ranks (with pp=2 and cp=1, ``dp``,
    ``dp_shard_cp`` and ``dp_cp`` would be three copies of ``dp_shard``'s).

    ``real_size1_groups=True`` (or ``RAY_MESH_REAL_SIZE1_GROUPS=1``) gives every dim a real
    group of its own again.

    ``layout`` (its reduce dtype, pipeline and replicate mode; its dims become ``spec``'s) is
    kept on the mesh for :func:`mesh_layout`; None: fp32, sync.
    """
    if not spec.is_resolved:
        raise BootstrapError(f"{spec} must be resolved before the mesh is built.")
    share = _sharing_enabled(real_size1_groups)
    # {dim: "fake"} for every named or flattened dim of size 1 (empty: all real).
    fake = ({d: "fake" for d in (*DIM_NAMES, *FLATTENED_DIMS) if spec.size(d) == 1}
            if share else {})
    named = {d: b for d, b in fake.items() if d in DIM_NAMES}
    mesh = init_device_mesh(device_type, tuple(spec.shape), mesh_dim_names=DIM_NAMES,
                            backend_override=named or None)
    # Sharing also needs torch's group-name field (the placeholder is a fake group).
    twins = twin_dims(spec) if share and private_apis.can_set_mesh_group(mesh) else {}
    flats: dict[str, DeviceMesh] = {}
    for flat, parts in FLATTENED_DIMS.items():
        twin = twins.get(flat)
        flat_mesh = private_apis.flatten_mesh(mesh[parts], flat,
                                              "fake" if twin else fake.get(flat))
        if twin:
            _share_group(flat_mesh, mesh.get_group(twin), flat)
        flats[flat] = flat_mesh
    # torch (2.11+) warns when a flattened dim is sliced from the root mesh and asks callers
    # to keep the flattened meshes themselves: keep them on the mesh for submesh().
    setattr(mesh, _FLAT_ATTR, flats)
    setattr(mesh, _LAYOUT_ATTR, replace(layout or Layout(), mesh=spec))
    return mesh


_FLAT_ATTR = "_ray_mesh_flattened"
_LAYOUT_ATTR = "_ray_mesh_layout"


def mesh_layout(mesh: DeviceMesh) -> Layout | None:
    """The layout ``mesh`` was built for (:func:`build_device_mesh`), or None for a mesh
    ray_mesh did not build. A slice (``mesh["dp_shard"]``) or flattened dim of such a mesh
    answers its root's: torch does not copy attributes onto the meshes it slices, and a
    helper given a slice must not fall back to fp32 or sync (the root link is
    ``private_apis.root_mesh``)."""
    own = getattr(mesh, _LAYOUT_ATTR, None)
    return own if own is not None else getattr(private_apis.root_mesh(mesh), _LAYOUT_ATTR, None)


def submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """``mesh[names]`` without slicing a flattened dim from the root mesh.

    For a mesh built by :func:`build_device_mesh`, a flattened dim (``dp``, ``dp_shard_cp``,
    ``dp_cp``) comes from the meshes ``_flatten`` returned; several dims are joined with
    :func:`_concatenate_meshes`. Any other mesh is sliced as usual.
    """
    flats: dict[str, DeviceMesh] = getattr(mesh, _FLAT_ATTR, {})
    if not any(n in flats for n in names):
        return mesh[names[0] if len(names) == 1 else names]
    if len(names) == 1:
        return flats[names[0]]
    return _concatenate_meshes([flats[n] if n in flats else mesh[n] for n in names])


def _concatenate_meshes(parts: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are ``parts`` (1-D meshes of one root), in order.

    Through ``private_apis.concatenate_meshes`` (``DeviceMesh._concatenate``): what slicing
    several dims does inside torch, and the only way to join a kept flattened mesh with a
    named dim without the root-slicing deprecation. It reuses the parts' process groups.
    """
    return private_apis.concatenate_meshes(parts)


def init_process_group(
    backend: str,
    device: torch.device,
    rank: int,
    world_size: int,
    timeout_s: float = DEFAULT_PG_TIMEOUT_S,
) -> None:
    """``init_process_group`` from MASTER_ADDR/MASTER_PORT, bound to ``device`` on GPUs."""
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(key):
            raise BootstrapError(
                f"{key} is not set: under torchrun it is set for you; otherwise export "
                f"MASTER_ADDR=<rank 0's address> MASTER_PORT=<free port> on every rank."
            )
    kwargs = {}
    if device.type == "cuda" and "nccl" in backend:
        # Binding the device lets NCCL create its communicator eagerly and makes
        # barrier()/split_group use the right GPU.
        kwargs["device_id"] = device
    timeout = timedelta(seconds=timeout_s)
    # torch's env:// rendezvous, with rank 0's store bound to MASTER_ADDR only and the join
    # counter checked (ray_mesh.core.rendezvous_store: the store has no authentication).
    store = rendezvous_store.create_store(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"),
                                          rank, world_size, timeout)
    # Each joining of the world gets keys of its own. torchrun's store outlives the group
    # (its agent hosts it), and a second init_process_group after destroy_process_group
    # names its groups as the first did: gloo read the previous round's addresses and
    # failed to connect ("Connection refused") after its retries.
    round_ = rendezvous_store.join_round(store, rank, world_size)
    store = dist.PrefixStore(f"ray_mesh/{round_}", store)
    teardown.bind_world_defaults()  # before the world group exists: see core/teardown.py
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)


def join_world(backend: str | None, local_rank: int, device: str | None, rank: int,
               world_size: int, timeout_s: float = DEFAULT_PG_TIMEOUT_S
               ) -> tuple[torch.device, str]:
    """Make this rank's device current and join the world process group (or check the one
    this process already joined); returns the device and the backend. The mesh is built on
    it by :func:`setup_worker`; ``mesh="auto"``'s trials join it first and leave it for that.
    """
    dev = pick_device(backend, local_rank, device)
    backend = backend or default_backend(dev)
    use_device(dev)
    if not dist.is_initialized():
        init_process_group(backend, dev, rank, world_size, timeout_s)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise BootstrapError(
            f"A process group already exists with rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the mesh wants rank {rank} of {world_size}."
        )
    return dev, backend


def setup_worker(
    spec: MeshSpec,
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    backend: str | None = None,
    device: str | None = None,
    timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    layout: Layout | None = None,
    picked: str = "",
) -> MeshState:
    """Everything a worker does to join the mesh; the Ray backend and torchrun both call it.

    ``env`` is the environment already in force (interface names etc.), kept for the
    layout table. ``layout``: the run's reduce dtype, pipeline and replicate mode (its dims
    are taken from ``spec`` once resolved; None: fp32, sync), held by the mesh and the
    state; ``picked``: why ``mesh="auto"`` chose it. Idempotent for the same spec and
    layout: a second call returns the existing state.
    """
    global _state
    with _lock:
        if _state is not None:
            same = layout is None or replace(layout, mesh=_state.spec) == _state.layout
            if _state.spec == spec and _state.rank == rank and same:
                return _state
            raise BootstrapError(
                f"This process already holds a mesh {_state.spec} as rank {_state.rank}; call "
                f"ray_mesh.shutdown_mesh() before building another."
            )
        resolved = spec if spec.is_resolved else spec.resolve(world_size)
        if resolved.world_size != world_size:
            raise BootstrapError(
                f"{resolved} has {resolved.world_size} ranks but the world size is {world_size}."
            )
        dev, backend = join_world(backend, local_rank, device, rank, world_size, timeout_s)
        mesh = build_device_mesh(resolved, dev.type, layout=layout)
        _state = MeshState(mesh, resolved, rank, world_size, local_rank, dev, backend,
                           dict(env or {}), mesh_layout(mesh) or Layout(), picked)
        return _state


def _env_int(name: str, default: int | None = None, *alternatives: str) -> int:
    for key in (name, *alternatives):
        if os.environ.get(key):
            try:
                return int(os.environ[key])
            except ValueError as exc:
                raise BootstrapError(f"{key}={os.environ[key]!r} is not an integer.") from exc
    if default is None:
        raise BootstrapError(
            f"{name} is not set. Start this script with torchrun (which sets RANK, WORLD_SIZE, "
            f"LOCAL_RANK), or through Ray Train with ray_mesh.MeshConfig."
        )
    return default


def init_mesh(
    spec: MeshSpec | Mapping | str | None = None,
    *,
    layout: Layout | Mapping | str | None = None,
    backend: str | None = None,
    device: str | None = None,
    timeout_s: float = DEFAULT_PG_TIMEOUT_S,
) -> DeviceMesh:
    """Build the mesh from torchrun's environment and return it (Ray-free entry point).

    ``'nodes'`` dims resolve to WORLD_SIZE / LOCAL_WORLD_SIZE, the node count under torchrun.
    ``layout`` (a :class:`~ray_mesh.core.layout.Layout`, its string or mapping) gives the
    reduce dtype, pipeline and replicate mode, and the dims when ``spec`` is None.

    Stability: stable
    """
    lay = None if layout is None else parse_layout(layout)
    if spec is None and lay is not None:
        spec = lay.mesh
    spec = MeshSpec.from_dict(spec)
    world_size = _env_int("WORLD_SIZE")
    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    if world_size % local_world:
        raise BootstrapError(
            f"WORLD_SIZE={world_size} is not a multiple of LOCAL_WORLD_SIZE={local_world}: "
            f"every node must run the same number of ranks (torchrun --nproc-per-node)."
        )
    resolved = spec.resolve(world_size, num_nodes=world_size // local_world)
    problem = resolved.inner_split_problem(local_world, unit="ranks")
    if problem:
        raise BootstrapError(f"{problem} Under torchrun the ranks per node are "
                             f"--nproc-per-node.")
    return setup_worker(resolved, rank=rank, world_size=world_size, local_rank=local_rank,
                        backend=backend, device=device, timeout_s=timeout_s,
                        layout=lay).mesh


def shutdown_mesh() -> None:
    """Forget the mesh, destroy the process group and free every group of the mesh, its
    threads joined (safe to call when none exists). Freed here, not at interpreter exit,
    where a gloo worker can abort the process: see :mod:`ray_mesh.core.teardown`.

    Stability: stable
    """
    global _state
    with _lock:
        mesh = _state.mesh if _state is not None else None
        _state = None
        teardown.destroy(mesh)
