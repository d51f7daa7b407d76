"""The DiLoCo benchmark's LM job: a byte-level Llama on the standard library's sources.

The model interface of :mod:`benchmarks.diloco` (``DEFAULTS``, ``make_model(cfg)``,
``batch(step, cfg)``, ``loss_fn``), plus the optional hooks it uses when present:
``place(model, mesh, dp)`` (TP-free Llama parallelization), ``optimizer(params, cfg)``
(AdamW as in ``examples/llm.py``), ``lr_factor(step, cfg)`` (linear warm-up, cosine decay)
and ``val_batch(i, cfg)`` (held-out files' rows).

The text is read as in ``examples/llm.py``: byte tokens of Python's own ``*.py`` files via
:mod:`ray_mesh.data`, a fixed fraction of the files held out (chosen by a hash of each file
name, so the split is the same everywhere), packed into rows of ``seq + 1`` bytes. The
global batch of a step is a seeded permutation of the training rows, a function of the
step alone, so sync HSDP and DiLoCo runs see the same tokens in the same order.
"""

from __future__ import annotations

import json

import torch
import torch.nn as nn
import torch.nn.functional as F

from ray_mesh.data.spec import DataSpec
from ray_mesh.data.text import load_split
from ray_mesh.models import Llama, LlamaConfig, parallelize_llama
from ray_mesh.models.schedule import warmup_cosine

DEFAULTS: dict = {
    "preset": "tiny", "seq": 128, "batch_size": 16, "lr": 3e-3, "warmup": 10,
    "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0,
    "validation": 0.05, "max_tokens": 1_000_000, "val_tokens": 32_768,
}
"""``steps`` (the schedule's length) comes from the benchmark's own ``steps``."""


def data_spec(cfg: dict) -> DataSpec:
    return DataSpec.from_dict({"paths": ["stdlib"], "seq_len": cfg["seq"],
                               "batch_size": cfg["batch_size"],
                               "validation": cfg["validation"],
                               "max_tokens": cfg["max_tokens"],
                               "val_tokens": cfg["val_tokens"]})


def make_model(cfg: dict) -> Llama:
    torch.manual_seed(cfg["seed"])  # every rank builds the same weights
    return Llama(LlamaConfig.from_dict({"preset": cfg["preset"], "max_seq_len": cfg["seq"]}))


def place(model: nn.Module, mesh, dp: str) -> nn.Module:
    """FSDP2 per block over the mesh's dp dims (``hsdp`` or ``replica``); no TP here."""
    return parallelize_llama(model, mesh, dp=dp)


def optimizer(params, cfg: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg["lr"], betas=(0.9, 0.95),
                             weight_decay=cfg["weight_decay"])


def lr_factor(step: int, cfg: dict) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine down to ``min_lr_ratio``."""
    return warmup_cosine(step, cfg["warmup"], cfg["steps"], cfg["min_lr_ratio"])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


_ROWS: dict[tuple[str, str], torch.Tensor] = {}
"""Rows read once per process (a plain dict: this file is loaded by path on the workers)."""


def rows(cfg: dict, split: str) -> torch.Tensor:
    spec = data_spec(cfg)
    key = (json.dumps(spec.to_dict(), sort_keys=True), split)
    if key not in _ROWS:
        _ROWS[key] = load_split(spec, split)[0]
    return _ROWS[key]


def batch(step: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the global batch of ``step``: a fresh permutation every epoch."""
    data, per = rows(cfg, "train"), cfg["batch_size"]
    per_epoch = len(data) // per
    if per_epoch == 0:
        raise ValueError(f"diloco_lm: {len(data)} training rows hold no batch of {per}; "
                         "raise max_tokens or lower batch_size")
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1_000_003 * epoch))
    tokens = data[order[index * per:(index + 1) * per]]
    return tokens[:, :-1], tokens[:, 1:]


def val_batch(i: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` of the held-out files' rows (in file order; not seen in training)."""
    data, per = rows(cfg, "validation"), cfg["batch_size"]
    if (i + 1) * per > len(data):
        raise ValueError(f"diloco_lm: validation holds {len(data)} rows, not {i + 1} batches "
                         f"of {per}; raise val_tokens or lower val_batches")
    tokens = data[i * per:(i + 1) * per]
    return tokens[:, :-1], tokens[:, 1:]
