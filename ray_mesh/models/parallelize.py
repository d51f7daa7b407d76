"""Put a :class:`~ray_mesh.models.llama.Llama` on the mesh: TP (+ sequence parallel), then
FSDP2 / HSDP over the dp dims -- torchtitan's llama3 ``parallelize.py`` on ray_mesh's helpers.

With sequence parallel the activations between blocks are sharded on the sequence over
``mesh["tp"]``: the embedding reduce-scatters its output onto the sequence, the norms run on
their shard, each attention / MLP all-gathers the sequence on entry and its rowwise output
projection reduce-scatters it again. Without it, the same layers run Megatron-style with
replicated activations and one all-reduce per projection.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import ray_mesh.private_apis as private_apis
from ray_mesh.core import bootstrap
from ray_mesh.models.llama import Llama
from ray_mesh.parallel import apply_fsdp, apply_tp
from ray_mesh.parallel.mesh import mesh_device
from ray_mesh.parallel.tp import make_style


def llama_tp_plan(sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The module path -> style plan for :class:`Llama` (torchtitan's, loss not parallel)."""
    if not sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attention.wq": make_style("colwise"),
            "layers.*.attention.wk": make_style("colwise"),
            "layers.*.attention.wv": make_style("colwise"),
            "layers.*.attention.wo": make_style("rowwise"),
            "layers.*.feed_forward.w1": make_style("colwise"),
            "layers.*.feed_forward.w3": make_style("colwise"),
            "layers.*.feed_forward.w2": make_style("rowwise"),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
    # The rotary table (attention's second input) stays a plain tensor: layout None.
    gather_seq = PrepareModuleInput(input_layouts=(Shard(1), None),
                                    desired_input_layouts=(Replicate(), None))
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": gather_seq,
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": make_style("rowwise_sp"),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": make_style("rowwise_sp"),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


NORM_DIM = "dp_shard_cp_tp"


def _flatten_norm_dims(mesh: DeviceMesh) -> None:
    """Flatten ``dp_shard_cp`` x ``tp`` into one named dim, when both are > 1.

    A gradient norm (``clip_grad_norm_``) of parameters sharded by FSDP2 over dp_shard_cp
    and by TP over tp is partial on both dims: without a flattened dim for the pair DTensor
    all-reduces twice, one dim after the other, and logs a warning on every rank saying
    so. With it, one all-reduce (one more process group, made once; again is a no-op)."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names or "dp_shard" not in names:
        return
    try:
        sub = bootstrap.submesh(mesh, "dp_shard_cp", "tp")
    except (KeyError, RuntimeError, ValueError):  # a mesh without ray_mesh's flattened dims
        return  # only the norm's speed (and torch's note) is at stake
    if sub.size() > mesh["tp"].size():  # dp_shard_cp > 1 as well
        private_apis.flatten_mesh(sub, NORM_DIM)


def parallelize_llama(
    model: Llama,
    mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    activation_checkpointing: bool = False,
    mixed_precision: Any = None,
    dp: str = "auto",
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """TP on ``mesh["tp"]`` (when tp > 1), activation checkpointing, then data parallel.

    ``model`` must hold the same weights on every rank (build it under one seed). Sizes are
    checked against tp before anything moves: heads, kv heads, vocab, MLP width and dim must
    all split evenly. Returns the model to use (the DDP path wraps it).
    """
    model = model.to(mesh_device(mesh))
    tp = mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
    if tp > 1:
        model.config.check_tp(tp)
        apply_tp(model, mesh, llama_tp_plan(sequence_parallel))
        if sequence_parallel:
            model.seq_divisor = tp
        if model.config.tie_embeddings:
            # TP replaced both modules' weights with separate DTensors (same values, same
            # Shard(0) placement on the vocab dim): share them again before FSDP groups them.
            model.tie_weights()
        _flatten_norm_dims(mesh)
    for layer in model.layers:
        layer.activation_checkpointing = activation_checkpointing
    return apply_fsdp(model, mesh, blocks="layers", mode=dp,  # type: ignore[arg-type]
                      mixed_precision=mixed_precision,
                      reshard_after_forward=reshard_after_forward)
