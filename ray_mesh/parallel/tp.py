"""Tensor parallel from a plan, on ``mesh["tp"]``, checked before any weight moves.

A plan maps module paths (``fnmatch`` patterns per dotted token, as
``parallelize_module`` reads them: ``"layers.*.attn.wq"``) to a torch ``ParallelStyle`` or a
short name. The short names cover the plain Megatron pattern and the sequence-parallel
variants, so that a plan can live in a YAML config::

    colwise      ColwiseParallel()                      shard out_features
    rowwise      RowwiseParallel()                      shard in_features, all-reduce
    colwise_sp   ColwiseParallel(input_layouts=Shard(1))   all-gather the sequence first
    rowwise_sp   RowwiseParallel(output_layouts=Shard(1))  reduce-scatter onto the sequence
    sequence     SequenceParallel()                     norms/dropout on a sequence shard

The check runs before ``parallelize_module`` because an uneven split is not an error in
DTensor: it silently pads or gives ranks different shard sizes, and the first symptom is a
shape error deep in a matmul, or a hang when ranks disagree on a collective's size.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ray_mesh.errors import ParallelError
from ray_mesh.parallel.mesh import MeshOrState, divisors, mesh_of, submesh

Style = ParallelStyle | str
TPPlan = Mapping[str, Style]

STYLE_NAMES = ("colwise", "rowwise", "colwise_sp", "rowwise_sp", "sequence")


def make_style(style: Style) -> ParallelStyle:
    """A ``ParallelStyle`` from a short name (see the module doc), or the style itself."""
    if isinstance(style, ParallelStyle):
        return style
    key = str(style).strip().lower().replace("-", "_")
    if key == "colwise":
        return ColwiseParallel()
    if key == "rowwise":
        return RowwiseParallel()
    if key == "colwise_sp":
        return ColwiseParallel(input_layouts=Shard(1))
    if key == "rowwise_sp":
        return RowwiseParallel(output_layouts=Shard(1))
    if key in ("sequence", "sequence_parallel", "sp"):
        return SequenceParallel()
    raise ParallelError(
        f"Unknown tensor-parallel style {style!r}: use one of {STYLE_NAMES}, or a "
        f"torch.distributed.tensor.parallel.ParallelStyle object."
    )


def match_plan(module: nn.Module, pattern: str) -> list[str]:
    """The paths of the submodules ``pattern`` selects, read as ``parallelize_module`` reads it."""
    if pattern == "":
        return [""]
    found = [("", module)]
    for token in pattern.split("."):
        found = [(f"{path}.{name}" if path else name, child)
                 for path, mod in found for name, child in mod.named_children()
                 if fnmatch(name, token)]
    return [path for path, _ in found]


def _split_size(mod: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """(what the style shards, its size) for the layers whose shard must be even."""
    colwise = isinstance(style, ColwiseParallel)
    rowwise = isinstance(style, RowwiseParallel)
    if isinstance(mod, nn.Linear):
        if colwise:
            return "out_features", mod.out_features
        if rowwise:
            return "in_features", mod.in_features
    if isinstance(mod, nn.Embedding):
        if colwise:
            return "embedding_dim", mod.embedding_dim
        if rowwise:
            return "num_embeddings", mod.num_embeddings
    return None


def _describe(mod: nn.Module) -> str:
    if isinstance(mod, nn.Linear):
        return f"Linear({mod.in_features} -> {mod.out_features})"
    if isinstance(mod, nn.Embedding):
        return f"Embedding({mod.num_embeddings}, {mod.embedding_dim})"
    return type(mod).__name__


def validate_tp_plan(module: nn.Module, plan: TPPlan, tp: int, *,
                     strict: bool = True) -> dict[str, ParallelStyle]:
    """Check ``plan`` against ``module`` for a tp degree, without any process group.

    Returns the plan with every pattern expanded to the paths it matches and every style
    built. ``strict`` makes a pattern that matches nothing an error (a typo); pipeline
    stages pass ``strict=False`` since each stage holds only some of the layers.
    """
    if not isinstance(tp, int) or tp < 1:
        raise ParallelError(f"tp must be a positive int, got {tp!r}.")
    if not isinstance(plan, Mapping):
        raise ParallelError(
            f"A tensor-parallel plan is a mapping of module path to style, e.g. "
            f"{{'net1': 'colwise', 'net2': 'rowwise'}}; got {type(plan).__name__}."
        )
    expanded: dict[str, ParallelStyle] = {}
    for pattern, raw in plan.items():
        style = make_style(raw)
        paths = match_plan(module, pattern)
        if not paths and strict:
            names = [n for n, _ in module.named_modules() if n][:12]
            raise ParallelError(
                f"tensor-parallel plan key {pattern!r} matches no submodule of "
                f"{type(module).__name__}. Its module paths include {names}. Fix the key "
                f"(patterns use fnmatch per dotted token, e.g. 'layers.*.wq')."
            )
        for path in paths:
            sub = module.get_submodule(path)
            split = _split_size(sub, style)
            if split and split[1] % tp:
                what, size = split
                kind = type(style).__name__
                raise ParallelError(
                    f"tensor parallel: layer {path!r} ({_describe(sub)}) is split by "
                    f"{kind} over its {what}={size}, which tp={tp} does not divide. Use a tp "
                    f"that divides {size} ({divisors(size)}), resize the layer, or leave "
                    f"it out of the plan (it is then replicated)."
                )
            expanded[path] = style
    return expanded


def tp_mesh(mesh: MeshOrState) -> DeviceMesh:
    """``mesh["tp"]``, with an error that says how to get one when the mesh has no tp dim."""
    return submesh(mesh, "tp", hint="Build it with ray_mesh (MeshConfig or init_mesh), or "
                                    "pass the 1-D tp mesh itself.")


def apply_tp(module: nn.Module, mesh: MeshOrState, plan: TPPlan, *,
             strict: bool = True) -> nn.Module:
    """Shard ``module`` over ``mesh["tp"]`` by ``plan`` (in place; returns it).

    ``mesh`` is the full ray_mesh mesh (its ``tp`` dim is used) or a 1-D tp mesh. With
    tp=1 the module is returned untouched: DTensor wrappers on one rank only cost time.
    Every rank must hold the same initial weights (build the model under one seed):
    ``parallelize_module`` shards from tp rank 0's copy.

    Stability: stable
    """
    mesh = mesh_of(mesh)
    sub = mesh if mesh.ndim == 1 and mesh.mesh_dim_names in (None, ("tp",)) else tp_mesh(mesh)
    tp = sub.size()
    expanded = validate_tp_plan(module, plan, tp, strict=strict)
    if tp == 1 or not expanded:
        return module
    return parallelize_module(module, sub, expanded)


__all__ = ["apply_tp"]
