"""Pipeline parallel along ``mesh["pp"]`` with a ``torch.distributed.pipelining`` schedule.

The model is a sequence of top-level layers (an ``nn.Sequential``, or a list / ordered dict
of named modules). :class:`PipelinePlan` cuts it into ``pp * stages_per_rank`` contiguous
stages and says which pp rank runs which stage; :class:`Pipeline` keeps this rank's stages,
applies TP then data parallel to each (torchtitan's order), wraps them in ``PipelineStage``
and runs the schedule.

Everything that can be wrong with the numbers is checked by :class:`PipelinePlan`
(:mod:`ray_mesh.parallel.pp.plan`) before a stage exists, on every rank
alike, so a bad input is an error everywhere and never one rank raising while its peers wait
in a ``recv``. The per-step batch check goes through one small all-reduce on the pp group
for the same reason: only the first stage sees the input and only the last sees the target.

Each stage module keeps the original layer names (``nn.Sequential`` accepts an ordered dict
with the original keys), so a stage's ``state_dict`` keys are the full model's keys: a
checkpoint or a reference comparison needs no renaming.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from ray_mesh.errors import ParallelError
from ray_mesh.parallel.mesh import MeshOrState, dim_size, mesh_device, submesh
from ray_mesh.parallel.pp.plan import (
    PipelinePlan,
    named_layers,
)
from ray_mesh.parallel.tp import validate_tp_plan

ParallelizeFn = Callable[..., nn.Module]
"""``fn(stage_module, mesh, *, tp_plan, dp, mixed_precision, strict_plan, reshard_after_forward)``
-> module: the step that puts TP and data parallel on one stage (``ray_mesh.parallel.parallelize``
has this signature); ``mesh`` is what the Pipeline was given, a mesh or a ``MeshState``."""


def _pp_mesh(mesh: MeshOrState) -> DeviceMesh:
    return submesh(mesh, "pp", hint="Build it with ray_mesh (MeshConfig or init_mesh) and a pp "
                                    "size, e.g. mesh: {pp: 2}.")


class Pipeline:
    """This rank's pipeline stages of ``model`` and the schedule that runs them.

    Each stage is cut, moved to the device, then parallelized, in one of two ways:

    * ``parallelize(stage_module) -> module``: your own call, applied as it is (for
      :func:`ray_mesh.parallel.parallelize`, pass ``strict_plan=False``: a stage holds only
      some of the layers a TP plan names);
    * ``tp_plan`` / ``dp`` / ``mixed_precision``: handed to ``parallelize_fn`` (as torchtitan's
      ``pipeline_llm`` takes ``parallelize_fn``), by default :attr:`default_parallelize_fn`
      or, when that is None, :func:`ray_mesh.parallel.parallelize` (imported at that call:
      ``compose``, which composes TP and FSDP, knows nothing of pipelines, and this module
      does not load it).

    Every rank must build ``model`` from the same seed.

    Stability: stable
    """

    default_parallelize_fn: ClassVar[ParallelizeFn | None] = None
    """The step for ``tp_plan`` / ``dp`` when none is passed; None: ``parallelize``."""

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module],
        mesh: MeshOrState,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        n_microbatches: int,
        schedule: str = "1f1b",
        stages_per_rank: int | None = None,
        layers_per_stage: Sequence[int] | None = None,
        batch_size: int | None = None,
        parallelize: Callable[[nn.Module], nn.Module] | None = None,
        tp_plan: Mapping[str, Any] | None = None,
        dp: str = "auto",
        mixed_precision: Any = None,
        parallelize_fn: ParallelizeFn | None = None,
        device: torch.device | None = None,
        check_batch: bool = True,
    ) -> None:
        layers = named_layers(model)
        pp_mesh = _pp_mesh(mesh)
        self.group = pp_mesh.get_group()
        self.backend = str(dist.get_backend(self.group))
        self.plan = PipelinePlan(
            pp=pp_mesh.size(), num_layers=len(layers), n_microbatches=n_microbatches,
            schedule=schedule, stages_per_rank=stages_per_rank,
            layers_per_stage=tuple(layers_per_stage) if layers_per_stage else None,
            batch_size=batch_size, backend=self.backend)
        if parallelize is None and (tp_plan or dp != "none"):
            parallelize = self._stage_step(parallelize_fn, mesh, layers, tp_plan=tp_plan, dp=dp,
                                           mixed_precision=mixed_precision)
        self.loss_fn = loss_fn
        self.check = check_batch
        self.device = device or mesh_device(mesh)
        self.pp_rank = pp_mesh.get_local_rank()
        self.stage_ids = self.plan.stages_of(self.pp_rank)
        ranges = self.plan.layer_ranges()
        num_stages = self.plan.num_stages
        self.modules: list[nn.Module] = []
        stages = []
        for sid in self.stage_ids:
            start, end = ranges[sid]
            module = nn.Sequential(OrderedDict(layers[start:end])).to(self.device)
            if parallelize is not None:
                module = parallelize(module)
            self.modules.append(module)
            stages.append(PipelineStage(module, sid, num_stages, self.device, group=self.group))
        cls = get_schedule_class(self.plan.torch_schedule)
        target = stages[0] if self.plan.style == "single" else stages
        self._no_target = False
        self.schedule = cls(target, n_microbatches=n_microbatches,
                            loss_fn=self._loss if loss_fn is not None else None)
        self.has_first = 0 in self.stage_ids
        self.has_last = num_stages - 1 in self.stage_ids
        self.last_owner = self.plan.owner(num_stages - 1)
        self.outputs: Any = None

    @classmethod
    def _stage_step(cls, parallelize_fn: ParallelizeFn | None, mesh: MeshOrState,
                    layers: list[tuple[str, nn.Module]], *, tp_plan: Mapping[str, Any] | None,
                    dp: str, mixed_precision: Any) -> Callable[[nn.Module], nn.Module]:
        """``stage -> parallelize_fn(stage, mesh, ...)`` with the stage options filled in."""
        fn = parallelize_fn or cls.default_parallelize_fn
        if fn is None:  # here, not at import: compose and the pipeline import nothing of
            from ray_mesh.parallel.compose import parallelize as fn  # each other at load
        if tp_plan:  # typos and uneven splits are caught on the whole model, on every rank
            validate_tp_plan(nn.Sequential(OrderedDict(layers)), tp_plan,
                             dim_size(mesh, "tp", default=1))

        def step(module: nn.Module) -> nn.Module:
            return fn(module, mesh, tp_plan=tp_plan, dp=dp, strict_plan=False,
                      mixed_precision=mixed_precision, reshard_after_forward=False)
        return step

    def parameters(self) -> Iterator[nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for module in self.modules:
            yield from module.named_parameters()

    # ------------------------------------------------------------------ running
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        if self._no_target:  # forward_only() without a target: torch wants a loss per microbatch
            return torch.zeros((), device=self.device)
        return self.loss_fn(output, target)  # type: ignore[misc]

    def _agree_on_batch(self, inputs: tuple, target: Any) -> int:
        """Check the batch on every pp rank at once (the first stage alone sees the input)."""
        sizes = torch.zeros(2, dtype=torch.int64, device=self.device)
        if self.has_first and inputs:
            sizes[0] = _batch_size(inputs[0])
        if self.has_last and target is not None:
            sizes[1] = _batch_size(target)
        dist.all_reduce(sizes, group=self.group)
        given, target_size = int(sizes[0]), int(sizes[1])
        if given == 0:
            raise ParallelError(
                "pipeline: the first stage got no input. Pass the batch to step() on the pp "
                "ranks that hold stage 0 (passing it on every rank is fine).")
        self.plan.check_batch(given)
        if self.loss_fn is not None and target_size not in (0, given):
            raise ParallelError(f"pipeline: the input has {given} samples but the target has "
                                f"{target_size}.")
        return given

    def step(self, *inputs: Any, target: Any = None) -> torch.Tensor:
        """One training step (forward + backward on every microbatch); no optimizer step.

        Pass the batch and the target on every rank, or at least the batch where stage 0 runs
        and the target where the last stage runs. Returns the mean microbatch loss (detached)
        on every pp rank, broadcast from the last stage; the outputs of the last stage are in
        ``self.outputs`` there.
        """
        if self.loss_fn is None:
            raise ParallelError("pipeline: step() trains and needs loss_fn; use forward_only() "
                                "for a forward pass only.")
        if self.check:
            self._agree_on_batch(inputs, target)
        if self.has_last and target is None:
            raise ParallelError("pipeline: the last stage needs the target to compute the loss.")
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.has_last:
            kwargs = {"target": target, "losses": losses}
        self.outputs = self.schedule.step(*(inputs if self.has_first else ()), **kwargs)
        return self._share_loss(losses)

    def eval(self, *inputs: Any, target: Any = None) -> Any:
        """Deprecated name of :meth:`forward_only` (it never switched modules to eval mode)."""
        warnings.warn("Pipeline.eval() is deprecated: it runs a forward pass only and does not "
                      "put the stages in eval mode like nn.Module.eval(); call "
                      "Pipeline.forward_only() instead.", DeprecationWarning, stacklevel=2)
        return self.forward_only(*inputs, target=target)

    @torch.no_grad()
    def forward_only(self, *inputs: Any, target: Any = None) -> Any:
        """The schedule's forward pass, no backward, under ``torch.no_grad``.

        Returns the last stage's output there and None on the other ranks. The stages stay
        in whatever train/eval mode they are in: call ``module.eval()`` on
        ``self.modules`` yourself for dropout/batch-norm inference behaviour.
        """
        given = self._agree_on_batch(inputs, None)
        kwargs: dict[str, Any] = {}
        if self.has_last and self.loss_fn is not None:
            self._no_target = target is None
            if target is None:  # a stand-in that torch can split into microbatches
                target = torch.zeros(given, device=self.device)
            kwargs = {"target": target, "losses": []}
        try:
            out = self.schedule.eval(*(inputs if self.has_first else ()), **kwargs)
        finally:
            self._no_target = False
        return out if self.has_last else None

    def _share_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.zeros((), device=self.device)
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).mean().to(self.device)
        dist.broadcast(loss, group=self.group, group_src=self.last_owner)
        return loss


def _batch_size(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.shape[0]) if x.ndim else 1
    if isinstance(x, list | tuple) and x:
        return _batch_size(x[0])
    if isinstance(x, Mapping) and x:
        return _batch_size(next(iter(x.values())))
    raise ParallelError(f"pipeline: cannot tell the batch size of a {type(x).__name__}; pass "
                        f"tensors with the batch on dim 0.")


__all__ = ["Pipeline"]
