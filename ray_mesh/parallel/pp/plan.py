"""Pipeline plans: how a model's layers are cut into stages and which pp rank runs each.

Pure arithmetic and torch's schedule registry, no process group: build a
:class:`PipelinePlan` on the driver to validate a config, or on every rank
(:class:`~ray_mesh.parallel.pp.pipeline.Pipeline` does) to learn this rank's stages. Everything that
can be wrong with the numbers (more stages than layers, microbatches that do not divide the
batch, a schedule's own microbatch rules, a schedule known to hang on the backend) is
checked here, on every rank alike, before a stage exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

import ray_mesh.private_apis as private_apis
from ray_mesh.core.layout import SCHEDULES, Layout, schedule_name
from ray_mesh.errors import LayoutError, ParallelError
from ray_mesh.parallel.mesh import divisors


def schedule_info(name: str) -> tuple[str, str]:
    """(torch schedule name, placement style) for a schedule name in any common spelling
    (the names are :data:`ray_mesh.core.layout.SCHEDULES`, a layout's spelling of them).

    Placement: ``single`` = one stage per rank; ``loop`` = rank r holds stages r, r+pp, ...;
    ``v`` = rank r holds stages r and 2*pp-1-r (ZBV, DualPipeV).
    """
    try:
        return SCHEDULES[schedule_name(name)]
    except LayoutError as exc:
        raise ParallelError(str(exc)) from None


def known_hang(schedule: str, backend: str) -> str | None:
    """Why ``schedule`` would hang on ``backend`` with this torch, or None if it is known to run.

    Before pytorch#152938 (torch 2.8), pipelining waited on only one of the ``Work`` objects
    that ``batch_isend_irecv`` returns; NCCL coalesces a batch into one, gloo returns one per
    op, so every schedule that batches a send with a recv (all but GPipe) deadlocked on gloo.
    The fix added ``_wait_batch_p2p``; its presence is the feature test. On torch 2.13 +
    gloo, GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBV and DualPipeV
    each run (2 and 4 ranks, up to 16 microbatches) and finish
    (upstream: torch-pipelining-gloo-batch-p2p).
    """
    torch_name, _ = schedule_info(schedule)
    if "nccl" in str(backend).lower() or torch_name == "GPipe":
        return None
    if not private_apis.has_batch_p2p_wait_fix():
        return (
            f"pipeline schedule {torch_name} deadlocks on the {backend!r} backend with torch "
            f"{torch.__version__}: its batched send/recv waits on one of several gloo works "
            f"(pytorch#132644, fixed in torch 2.8). Use schedule='gpipe', upgrade torch to "
            f">= 2.8, or train on GPUs with NCCL."
        )
    return None


@dataclass(frozen=True)
class PipelinePlan:
    """How a model of ``num_layers`` layers is cut and scheduled over ``pp`` ranks.

    Pure arithmetic, no process group: build one on the driver to validate a config, or on
    every rank (what :class:`Pipeline` does) to learn this rank's stages.
    """

    pp: int
    num_layers: int
    n_microbatches: int
    schedule: str = "1f1b"
    stages_per_rank: int | None = None
    layers_per_stage: tuple[int, ...] | None = None
    batch_size: int | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        torch_name, style = schedule_info(self.schedule)
        for name in ("pp", "num_layers", "n_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParallelError(f"pipeline: {name} must be a positive int, got {value!r}.")
        spr = self.stages_per_rank
        if spr is None:
            spr = 1 if style == "single" else 2
            object.__setattr__(self, "stages_per_rank", spr)
        if isinstance(spr, bool) or not isinstance(spr, int) or spr < 1:
            raise ParallelError(f"pipeline: stages_per_rank must be a positive int, got {spr!r}.")
        if style == "single" and spr != 1:
            raise ParallelError(
                f"pipeline schedule {torch_name} runs one stage per rank, got "
                f"stages_per_rank={spr}. Use schedule='interleaved_1f1b' for several stages "
                f"per rank, or stages_per_rank=1."
            )
        if style == "v" and spr != 2:
            raise ParallelError(
                f"pipeline schedule {torch_name} needs exactly 2 stages per rank (a V shape), "
                f"got stages_per_rank={spr}."
            )
        self._check_layers()
        self._check_microbatches(torch_name, style)
        if self.batch_size is not None:
            self.check_batch(self.batch_size)
        if self.backend is not None:
            reason = known_hang(self.schedule, self.backend)
            if reason:
                raise ParallelError(reason)

    @classmethod
    def from_layout(cls, layout: Layout, num_layers: int, **options: Any) -> PipelinePlan:
        """The stage plan of ``layout``'s pipeline: its ``pp`` (resolved), its schedule
        (default 1f1b) and microbatches; ``options`` are the other fields (stages_per_rank,
        layers_per_stage, batch_size, backend)."""
        pp = layout.mesh.pp
        if not isinstance(pp, int) or pp < 1:
            raise ParallelError(f"layout {layout}: pp={pp!r} is not sized yet; resolve the "
                                "layout on the cluster first (Layout.resolved)")
        return cls(pp=pp, num_layers=num_layers, n_microbatches=layout.microbatches,
                   schedule=layout.schedule or "1f1b", **options)

    # ------------------------------------------------------------------ checks
    def _check_layers(self) -> None:
        stages = self.num_stages
        if stages > self.num_layers:
            raise ParallelError(
                f"pipeline: pp={self.pp} x stages_per_rank={self.stages_per_rank} = {stages} "
                f"stages, but the model has only {self.num_layers} layers to split. Lower pp "
                f"or stages_per_rank to at most {self.num_layers} stages in all, or split the "
                f"model into more top-level layers."
            )
        if self.layers_per_stage is not None:
            counts = tuple(self.layers_per_stage)
            if len(counts) != stages or any(not isinstance(c, int) or c < 1 for c in counts):
                raise ParallelError(
                    f"pipeline: layers_per_stage={list(counts)} must give a positive layer "
                    f"count for each of the {stages} stages."
                )
            if sum(counts) != self.num_layers:
                raise ParallelError(
                    f"pipeline: layers_per_stage={list(counts)} sums to {sum(counts)}, but "
                    f"the model has {self.num_layers} layers."
                )

    def _check_microbatches(self, torch_name: str, style: str) -> None:
        n, stages = self.n_microbatches, self.num_stages
        if torch_name in ("1F1B", "DualPipeV") and n < stages:
            raise ParallelError(
                f"pipeline schedule {torch_name} needs at least as many microbatches as stages "
                f"({stages}), got n_microbatches={n}. Use n_microbatches >= {stages}, or "
                f"schedule='gpipe'."
            )
        if torch_name in ("Interleaved1F1B", "InterleavedZeroBubble"):
            rounds = max(1, n // self.pp)
            if n % rounds:
                raise ParallelError(
                    f"pipeline schedule {torch_name} runs microbatches in rounds of pp={self.pp}; "
                    f"n_microbatches={n} is not a multiple of its {rounds} rounds. Use a "
                    f"multiple of pp (e.g. {self.pp * rounds}) or at most {self.pp}."
                )

    def check_batch(self, batch_size: int) -> None:
        """Raise unless ``batch_size`` splits into ``n_microbatches`` equal microbatches."""
        n = self.n_microbatches
        if batch_size < n or batch_size % n:
            raise ParallelError(
                f"pipeline: n_microbatches={n} does not divide the batch of {batch_size} "
                f"samples (per data-parallel rank). Use n_microbatches in "
                f"({divisors(batch_size)}), "
                f"or a batch size that is a multiple of {n}. Unequal microbatches would weigh "
                f"samples unequally in the loss."
            )

    # ------------------------------------------------------------------ layout
    @property
    def num_stages(self) -> int:
        return self.pp * int(self.stages_per_rank or 1)

    @property
    def style(self) -> str:
        return schedule_info(self.schedule)[1]

    @property
    def torch_schedule(self) -> str:
        return schedule_info(self.schedule)[0]

    def layer_ranges(self) -> list[tuple[int, int]]:
        """[start, end) layer indices of every stage, in stage order."""
        if self.layers_per_stage is not None:
            counts = list(self.layers_per_stage)
        else:
            base, extra = divmod(self.num_layers, self.num_stages)
            counts = [base + (1 if s < extra else 0) for s in range(self.num_stages)]
        ranges, start = [], 0
        for c in counts:
            ranges.append((start, start + c))
            start += c
        return ranges

    def owner(self, stage: int) -> int:
        """The pp rank that runs ``stage``."""
        if self.style == "v":
            return stage if stage < self.pp else self.num_stages - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` runs, in the order the schedule wants them."""
        return [s for s in range(self.num_stages) if self.owner(s) == pp_rank]


def named_layers(model: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
                 ) -> list[tuple[str, nn.Module]]:
    """The top-level layers to split, with the names their parameters carry in the model."""
    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    if isinstance(model, Mapping):
        return [(str(k), v) for k, v in model.items()]
    if isinstance(model, Sequence) and not isinstance(model, str | nn.Module):
        return [(str(i), m) for i, m in enumerate(model)]
    raise ParallelError(
        f"pipeline: cannot split a {type(model).__name__} into stages. Give an nn.Sequential "
        f"(or a list / ordered dict of modules) whose layers run one after the other, each "
        f"taking the previous one's output."
    )
