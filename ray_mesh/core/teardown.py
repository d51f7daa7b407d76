"""What :func:`ray_mesh.shutdown_mesh` does after forgetting the mesh: no group outlives it.

``dist.destroy_process_group()`` drops torch's own references to every process group, but in
torch 2.13.0 each DeviceMesh keeps one more in its ``_pg_registry`` (``private_apis.
release_mesh_groups``; upstream: torch-mesh-keeps-groups), and meshes live on: the one a
script still holds (``mesh = init_mesh(...)``, the usual torchrun script), those DTensor's
sharding caches hold. Left alone, every gloo group, with its ``pt_gloo_runloop`` worker
threads, lives until interpreter exit, and that can kill a rank after its last line:

A gloo worker drops the ``Work`` of a collective after it has woken the caller. When it holds
the last reference, freeing the Work's tensors releases their Python objects, which takes
the GIL. Once the interpreter is finalizing, taking the GIL ends the thread
(``PyThread_exit_thread`` -> ``pthread_exit``); the unwind through the noexcept
``~AsyncWork`` calls ``std::terminate``: SIGABRT, "terminate called without an active
exception". Core dumps of tests/dist/test_bootstrap.py's torchrun ranks (6 of 15 runs):
the main thread in ``Py_FinalizeEx``, the aborting thread in ``take_gil`` <-
``TensorImpl::decref_pyobject`` <- ``~AsyncAllreduceWork`` <- ``ProcessGroupGloo::runLoop``.
pytorch#179291 is the same crash for a process that never calls destroy_process_group.

So the groups are freed here, with the interpreter whole: ``gc.collect()`` frees those held
by unreachable cycles (an FSDP-wrapped model gone out of scope), then every live mesh lets go
of its groups. Releasing the last reference from Python runs ``~ProcessGroupGloo`` with the
GIL released (c10d's no-GIL holder); it waits for the queue, stops the workers and joins
them, each finishing its Work first. A group something else still holds (a live FSDP model,
a kept ``mesh.get_group()``) cannot be freed: a warning names its dims and what to drop.

One holder is torch's own: ``torch.distributed.nn.functional`` binds ``group.WORLD`` as the
default argument of its collectives *when it is imported*, and ``torch.distributed.fsdp``
imports it. Imported after the world group exists (under Ray always: the train function's
module, and with it FSDP, is loaded after the mesh came up), every such function keeps the
world group, the ``dp`` group of a mesh whose dp dims span the world, alive for good (the
README's main job would warn on every rank). :func:`bind_world_defaults` imports it first, so
those defaults are None (the default group at call time, as torch means them;
upstream: torch-nn-functional-binds-world).
"""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import ray_mesh.private_apis as private_apis
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS

logger = logging.getLogger(__name__)


def bind_world_defaults() -> None:
    """Import the torch modules that bind the world group at import time, before there is
    one (see the module docstring); called before ``init_process_group``."""
    import torch.distributed.nn.functional  # noqa: F401 - its defaults: group=group.WORLD


def real_groups(mesh: Any) -> dict[str, weakref.ref]:
    """``{"dim=dim": group}`` (weakly) for the mesh's groups with a communicator: "fake"
    groups (size-1 dims) have no threads."""
    dims: dict[str, list[str]] = {}
    groups: dict[str, Any] = {}
    for dim in (*DIM_NAMES, *FLATTENED_DIMS):
        try:
            group = mesh.get_group(dim)
            if dist.get_backend(group) == "fake":
                continue
        except Exception:  # noqa: BLE001 - a dim this mesh lacks
            continue
        dims.setdefault(group.group_name, []).append(dim)
        groups[group.group_name] = group
    return {"=".join(dims[name]): weakref.ref(g) for name, g in groups.items()}


def _release_all() -> None:
    """Empty the group registry of every DeviceMesh alive, ours and any other (a script's
    own, one kept alive by DTensor's sharding caches). Only after destroy_process_group,
    when no registered group is usable any more.

    The sweep checks each object's *type* (``issubclass(type(o), DeviceMesh)``), never
    ``isinstance(o, DeviceMesh)``: DeviceMesh's metaclass (torch's ``OpaqueBaseMeta``) answers
    ``isinstance`` by reading attributes of the object, and among all live objects is
    ``torch.distributed.reduce_op``, whose every attribute access warns (a FutureWarning per
    rank at the end of every run)."""
    for m in [o for o in gc.get_objects() if issubclass(type(o), DeviceMesh)]:
        private_apis.release_mesh_groups(m)


def destroy(mesh: Any | None) -> None:
    """``destroy_process_group()``, then free every group that only meshes or unreachable
    garbage still held; warn about the groups of ``mesh`` that something else holds."""
    initialized = dist.is_available() and dist.is_initialized()
    watched = real_groups(mesh) if mesh is not None and initialized else {}
    if initialized:
        dist.destroy_process_group()
    gc.collect()  # cycles first (FSDP modules hold meshes and groups), then live meshes
    _release_all()
    held = sorted(label for label, ref in watched.items() if ref() is not None)
    if held:
        logger.warning(
            "ray_mesh.shutdown_mesh(): the process group(s) of %s are still referenced (by a "
            "model wrapped with FSDP, a kept mesh.get_group(...), ...), so not freed: their "
            "communicator threads live until interpreter exit, where a gloo worker still "
            "finishing a collective can abort the process (SIGABRT, 'terminate called "
            "without an active exception'). Drop those references (del model) before "
            "shutdown_mesh().", ", ".join(held))
