"""Data parallel on the mesh: FSDP2 (``fully_shard``), HSDP, or replicate-only (DDP).

Which one follows from the mesh, so a job changes layout by changing its mesh, not its code:

    dp_replicate  dp_shard*cp   what runs
    1             1             nothing (one data-parallel rank)
    1             >1            FSDP over ``dp_shard_cp``
    >1            >1            HSDP over (``dp_replicate``, ``dp_shard_cp``): shard inside,
                                all-reduce across
    >1            1             replicate-only: torch DDP over ``dp_cp``; when the model
                                already holds DTensors (TP), FSDP2 on the 2-D mesh with a
                                shard dim of 1, which is the same all-reduce and composes
                                with TP where DDP does not

``fully_shard`` is applied per block first and then to the root, as FSDP2 wants: each block
becomes one all-gather / reduce-scatter group, and the root picks up what is left (embeddings,
final norm, head). Call it after tensor parallel (torchtitan's order), once per pipeline stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ray_mesh.errors import ParallelError
from ray_mesh.parallel.mesh import MeshOrState, mesh_of, submesh
from ray_mesh.parallel.picked import layout_precision

_DP_HINT = ("Data parallel needs the ray_mesh mesh (dp_replicate, dp_shard, cp and the "
            "flattened dp_shard_cp, dp_cp): get it from ray_mesh.get_mesh() or "
            "ray_mesh.init_mesh().")

Mode = Literal["auto", "fsdp", "hsdp", "ddp", "replica", "none"]
Blocks = Iterable[nn.Module] | str | Callable[[str, nn.Module], bool] | None

PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "fp32": (None, None),
    "bf16": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float32),
    "bf16_reduce": (torch.bfloat16, torch.bfloat16),
    # fp32 compute, gradients reduced in bf16: half the bytes of every gradient reduction
    # (the replicate all-reduce across nodes included) at no cost to the forward pass.
    "bf16_grads": (None, torch.bfloat16),
}
"""name -> (param dtype in compute, dtype gradients are reduced in)."""


def mixed_precision_policy(spec: str | MixedPrecisionPolicy | None) -> MixedPrecisionPolicy:
    """A ``MixedPrecisionPolicy`` from a name in :data:`PRECISIONS`, a policy, or None (fp32).

    ``bf16`` computes in bf16 and reduces gradients in fp32, torchtitan's default: reducing in
    bf16 loses the low bits of the gradient sum as the dp degree grows.
    """
    if spec is None:
        return MixedPrecisionPolicy()
    if isinstance(spec, MixedPrecisionPolicy):
        return spec
    key = str(spec).strip().lower()
    if key not in PRECISIONS:
        raise ParallelError(
            f"Unknown mixed precision {spec!r}: use one of {tuple(PRECISIONS)}, None, or a "
            f"torch.distributed.fsdp.MixedPrecisionPolicy."
        )
    param, reduce = PRECISIONS[key]
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def _size(mesh: DeviceMesh, name: str) -> int:
    return submesh(mesh, name, hint=_DP_HINT).size()


def resolve_mode(mesh: DeviceMesh, mode: Mode = "auto") -> Mode:
    """The data-parallel mode the mesh calls for, or a check that ``mode`` fits the mesh."""
    rep, shard = _size(mesh, "dp_replicate"), _size(mesh, "dp_shard_cp")
    natural: Mode = ("none" if rep == 1 and shard == 1 else "fsdp" if rep == 1
                     else "ddp" if shard == 1 else "hsdp")
    if mode == "auto":
        return natural
    if mode not in ("fsdp", "hsdp", "ddp", "replica", "none"):
        raise ParallelError(f"Unknown data-parallel mode {mode!r}: use auto, fsdp, hsdp, ddp, "
                            f"replica or none.")
    fits = {
        "none": True,  # opting out (e.g. replicas that run apart, or DP done elsewhere)
        # FSDP inside each replica only: replicas run apart and an outer loop (DiLoCo,
        # ray_mesh.parallel.diloco) keeps them together.
        "replica": True,
        "fsdp": rep == 1,
        "hsdp": rep > 1 or shard > 1,
        "ddp": shard == 1,
    }
    if not fits[mode]:
        raise ParallelError(
            f"data-parallel mode {mode!r} does not fit the mesh (dp_replicate={rep}, "
            f"dp_shard*cp={shard}); the mesh calls for {natural!r}. Use mode='auto', or "
            f"change the mesh: fsdp wants dp_replicate=1, ddp wants dp_shard=cp=1."
        )
    return mode


def find_blocks(module: nn.Module, blocks: Blocks = None) -> list[nn.Module]:
    """The submodules that each get their own ``fully_shard`` call.

    ``blocks`` may be the modules, an attribute path (``"layers"``: its children), a predicate
    on (path, module), or None: then the children of the first ``ModuleList``/``ModuleDict``
    named ``layers``/``blocks``/``h``, else the children of an ``nn.Sequential`` that hold
    parameters, else none (the root alone).
    """
    if blocks is None:
        for attr in ("layers", "blocks", "h"):
            holder = getattr(module, attr, None)
            if isinstance(holder, nn.ModuleList | nn.ModuleDict | nn.Sequential):
                return list(holder.children())
        if isinstance(module, nn.Sequential):
            return [m for m in module.children() if any(True for _ in m.parameters())]
        return []
    if isinstance(blocks, str):
        try:
            holder = module.get_submodule(blocks)
        except AttributeError as exc:
            raise ParallelError(f"blocks={blocks!r}: {type(module).__name__} has no submodule "
                                f"{blocks!r}. Name the ModuleList that holds the blocks.") from exc
        return list(holder.children())
    if callable(blocks):
        return [m for name, m in module.named_modules() if name and blocks(name, m)]
    return list(blocks)


def _has_dtensor(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_fsdp(
    module: nn.Module,
    mesh: MeshOrState,
    *,
    blocks: Blocks = None,
    mode: Mode = "auto",
    mixed_precision: str | MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """Apply data parallel to ``module`` as the mesh's dp dims call for; returns the module.

    In place for FSDP/HSDP (``fully_shard`` changes the module's class); the DDP path returns
    a ``DistributedDataParallel`` wrapper, so always use the return value. Every rank must
    start from the same weights (one seed): FSDP shards the local copy, it does not broadcast.
    ``mixed_precision=None`` follows the reduce dtype of the layout ``mesh`` was built for
    (:mod:`ray_mesh.parallel.picked`; fp32 for a mesh without one); ``mesh`` may be the
    worker's :class:`~ray_mesh.MeshState`, whose layout is then the one followed.

    Stability: stable
    """
    precision = layout_precision(mesh) if mixed_precision is None else mixed_precision
    mesh = mesh_of(mesh)
    mode = resolve_mode(mesh, mode)
    if mode == "replica" and _size(mesh, "dp_shard_cp") == 1:
        mode = "none"  # a replica of one rank (or one tp group): nothing to shard
    if mode == "none":
        return module
    if mode == "ddp" and not _has_dtensor(module):
        if mixed_precision not in (None, "fp32"):
            raise ParallelError(
                "mixed_precision is an FSDP2 option; the replicate-only (DDP) path trains in "
                "the module's own dtype. Use torch.autocast, or a dp_shard > 1 mesh."
            )
        device = mesh.device_type
        ids = [torch.cuda.current_device()] if device == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=ids,
                                                   device_mesh=submesh(mesh, "dp_cp"))
    dp_mesh = (submesh(mesh, "dp_shard_cp") if mode in ("fsdp", "replica")
               else submesh(mesh, "dp_replicate", "dp_shard_cp"))
    policy = mixed_precision_policy(precision)
    for block in find_blocks(module, blocks):
        if block is module:
            continue
        block.register_forward_hook(own_output)  # before fully_shard's: FSDP sees the result
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    module.register_forward_hook(own_output)
    fully_shard(module, mesh=dp_mesh, mp_policy=policy,
                reshard_after_forward=reshard_after_forward)
    return module


def own_output(module: nn.Module, args: Any, output: Any) -> Any:
    """A forward hook: a grad-requiring output that is a view becomes a tensor of its own.

    FSDP2 hooks its pre-backward all-gather onto each wrapped module's outputs; on a view an
    in-place op by the caller (``out += y``) silently drops that hook and skips the
    all-gather, and torch warns on every forward. Views are common outputs: ``nn.Linear`` on
    a 3-D input returns a view of its 2-D matmul, tensor parallel the local view of an
    all-gathered buffer. One copy of such an output (an activation, once per forward) makes
    it safe; outputs that are not views pass untouched. Registered before ``fully_shard``'s
    own hook, so FSDP hooks the copy (upstream: torch-fsdp2-view-output-hook)."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._base is not None and output.requires_grad else output
    if isinstance(output, tuple | list) and any(
            isinstance(t, torch.Tensor) and t._base is not None for t in output):
        return type(output)(own_output(module, args, t) for t in output)
    return output


__all__ = ["apply_fsdp"]
