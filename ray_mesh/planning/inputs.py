"""The inputs of a layout plan, from a job file's ``plan:`` section (Ray-free).

```yaml
mesh: auto                  # pick the layout with the lowest predicted step time
plan:
  model: {params: 2000000, layers: 4, hidden: 128, heads: 4}   # or a factory:
  # model: fsdp_tp_transformer.py:make_model    (built on the meta device with `config`)
  tokens_per_step: 1024     # global batch in tokens
  compute_s: 2.0            # one rank's compute time for the whole global batch
  microbatches: 4           # pipeline layouts
  link_mbit: 100            # optional: else measured on the live cluster
  latency_ms: 0             # optional: one-way latency of the node link (not measurable here)
  memory_gb: 80             # optional: per-rank memory limit
  layouts: [ddp, fsdp, hsdp]  # the families the train function can run (this default:
                            # any loop that calls ray_mesh.parallel.parallelize / apply_fsdp);
                            # add tp_hsdp, pp, tp_pp when it handles tp / pipeline stages
  precisions: [fp32, bf16_grads]  # gradient reductions it accepts (default [fp32];
                            # `bf16_grads: true` is the same as this list)
  replicate: [sync, diloco] # replicate modes it accepts (default [sync]); or a mapping
                            # {every: 50, compress: int8}: sync + DiLoCo with these settings
  step: fsdp_tp_transformer.py:make_step  # optional: make_step(mesh, config) -> step();
                            # mesh: auto then times every candidate with it at bring-up
                            # and picks the measured fastest (ray_mesh.planning.trial)
  trial_steps: 3            # timed steps per candidate, after one warm-up step
  trial_budget_s: 120       # no candidate starts after this many seconds of trials
```

``mesh: auto`` picks among ``layouts`` x ``precisions`` x ``replicate`` and hands the pick
to the workers: ``parallelize``/``apply_fsdp`` (``mixed_precision`` left unset) reduce in
the picked dtype, ``ray_mesh.parallel.replicate_config()``/``wrap_replicate()``/``dp_mode()``
follow the picked replicate mode, so a train function written with them follows the pick
with no code change. A list without ``fp32`` (or ``sync``) drops the layouts that have a
bf16 (or DiLoCo) variant in favour of it.

With ``step``, the model's ranking only orders the trials: each candidate's mesh is built
on the live cluster and the job's own step timed on it (a slow one stopped after one step),
because a prediction from one ``compute_s`` misses what a step costs the host beyond its
arithmetic (:mod:`ray_mesh.planning.trial`).

Every key is checked here, on the driver, with the key and the fix in the message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ray_mesh.core.layout import DiLoCoConfig, LayoutError, check_family
from ray_mesh.core.values import brief
from ray_mesh.planning.cost import (
    DATA_PARALLEL,
    PLANNED_FAMILIES,
    Links,
    ModelStats,
    PlanError,
    Prediction,
    Workload,
    rank_layouts,
)
from ray_mesh.planning.trial import StepFactory, check_trial_settings

KEYS = ("model", "tokens_per_step", "compute_s", "microbatches", "link_mbit", "latency_ms",
        "memory_gb", "backend", "layouts", "bf16_grads", "precisions", "replicate", "step",
        "trial_steps", "trial_budget_s")
PRECISIONS = ("fp32", "bf16_grads")
REPLICATE_MODES = ("sync", "diloco")


def _number(section: str, key: str, value: Any, *, low: float, high: float = math.inf,
            integer: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and not (
        integer and not isinstance(value, int))
    if not ok or not (low <= value < high) or (isinstance(value, float) and math.isnan(value)):
        kind = "an integer" if integer else "a number"
        raise PlanError(f"{section}.{key}: {brief(value)} is not {kind} in [{low:g}, {high:g}); "
                        f"e.g. {key}: {int(low) + 1 if integer else low + 1:g}")
    return value


@dataclass(frozen=True)
class PlanInputs:
    """What ``mesh: auto`` and ``ray-mesh plan JOB.yaml`` plan with.

    Stability: experimental
    """

    stats: ModelStats
    work: Workload
    link_mbit: float | None = None
    latency_s: float = 0.0
    memory_bytes: float | None = None
    backend: str | None = None
    layouts: tuple[str, ...] = DATA_PARALLEL
    precisions: tuple[str, ...] = ("fp32",)
    diloco: DiLoCoConfig | None = None  # DiLoCo allowed, with these settings
    sync: bool = True  # sync replication allowed (False: only DiLoCo layouts)
    step: StepFactory | None = None  # the job's step on a mesh: mesh="auto" times each layout
    step_config: dict = field(default_factory=dict)  # the step's config (the job's config:)
    trial_steps: int = 3
    trial_budget_s: float = 120.0

    def __post_init__(self) -> None:
        if self.step is not None:
            if not callable(self.step):
                raise PlanError(f"plan.step: {self.step!r} is not a function; give "
                                "make_step(mesh, config) -> step() ('file.py:make_step')")
            if self.diloco is not None:
                raise PlanError("plan.step times sync layouts only (DiLoCo's outer sync "
                                "every H steps is not in a few trial steps): use plan.replicate:"
                                " [sync], or leave plan.step out to rank DiLoCo by prediction")
            check_trial_settings(self.trial_steps, self.trial_budget_s)
        if not self.precisions or set(self.precisions) - set(PRECISIONS):
            raise PlanError(f"plan.precisions: {brief(list(self.precisions))}; give a "
                            f"non-empty list from {', '.join(PRECISIONS)}")
        if not self.sync and self.diloco is None:
            raise PlanError("plan.replicate allows no mode: list sync, diloco or both")

    @property
    def bf16_grads(self) -> bool:
        return "bf16_grads" in self.precisions

    def rank(self, links: Links) -> list[Prediction]:
        """The allowed layouts for ``links``, fastest predicted first."""
        ranked = rank_layouts(self.stats, links, self.work, self.memory_bytes, self.layouts,
                              self.bf16_grads, self.diloco)
        layouts = {p.layout for p in ranked}
        kept = [p for p in ranked if (self.sync or p.layout.diloco) and (
            "fp32" in self.precisions or p.layout.reduce == "bf16"
            or replace(p.layout, reduce="bf16") not in layouts)]
        if not kept:
            raise PlanError(f"no layout of {list(self.layouts)} runs with precisions "
                            f"{list(self.precisions)} and replicate "
                            f"{'sync' if self.sync else 'diloco'} only; allow more in plan:")
        return kept

    @classmethod
    def from_dict(cls, data: Any, load_factory: Callable[[str], Callable[..., Any]],
                  model_config: Mapping[str, Any] | None = None) -> PlanInputs:
        """Parse a ``plan:`` section; ``load_factory`` imports a ``file.py:function`` ref."""
        if not isinstance(data, Mapping):
            raise PlanError("plan: must be a mapping with at least model, tokens_per_step and "
                            "compute_s (see `ray-mesh plan --help`)")
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise PlanError(f"plan: unknown key(s) {unknown}; known: {', '.join(KEYS)}")
        for key in ("model", "tokens_per_step", "compute_s"):
            if key not in data:
                raise PlanError(f"plan.{key} is missing: the planner needs the model's size, "
                                "the global tokens per step and one rank's compute time for "
                                "them (seconds)")
        stats = _model_stats(data["model"], load_factory, model_config or {})
        work = Workload(int(_number("plan", "tokens_per_step", data["tokens_per_step"], low=1,
                                    integer=True)),
                        float(_number("plan", "compute_s", data["compute_s"], low=0)),
                        int(_number("plan", "microbatches", data.get("microbatches", 4), low=1,
                                    integer=True)))
        link = data.get("link_mbit")
        mem = data.get("memory_gb")
        backend = data.get("backend")
        if backend not in (None, "gloo", "nccl"):
            raise PlanError(f"plan.backend: {brief(backend)}; use gloo or nccl (default: the "
                            "cluster's, nccl with GPUs)")
        layouts = data.get("layouts", list(DATA_PARALLEL))
        if not isinstance(layouts, list) or not layouts:
            raise PlanError(f"plan.layouts: {brief(layouts)}; give a list of layout families from "
                            f"{', '.join(PLANNED_FAMILIES)} (the ones the train function "
                            "can run)")
        for name in layouts:
            try:
                check_family(name)
            except LayoutError as exc:
                raise PlanError(f"plan.layouts: {exc}") from None
            if name not in PLANNED_FAMILIES:
                raise PlanError(f"plan.layouts: the planner does not rank {brief(name)}; choose "
                                f"from {', '.join(PLANNED_FAMILIES)}")
        bf16 = data.get("bf16_grads", False)
        if not isinstance(bf16, bool):
            raise PlanError(f"plan.bf16_grads: {brief(bf16)} must be true or false")
        precisions = data.get("precisions", ["fp32", "bf16_grads"] if bf16 else ["fp32"])
        if not isinstance(precisions, list):
            raise PlanError(f"plan.precisions: {brief(precisions)}; give a list like "
                            "[fp32, bf16_grads]")
        sync, diloco = _replicate(data.get("replicate"))
        step = data.get("step")
        if step is not None and not isinstance(step, str):
            raise PlanError(f"plan.step: {brief(step)}; give 'file.py:make_step' (a function "
                            "make_step(mesh, config) returning one training step)")
        trial = {"step": None if step is None else load_factory(step),
                 "step_config": dict(model_config or {}),
                 "trial_steps": data.get("trial_steps", 3),
                 "trial_budget_s": data.get("trial_budget_s", 120.0)}
        return cls(stats, work,
                   None if link is None else float(_number("plan", "link_mbit", link,
                                                           low=1e-3)),
                   float(_number("plan", "latency_ms", data.get("latency_ms", 0), low=0,
                                 high=10_000)) / 1e3,
                   None if mem is None else float(_number("plan", "memory_gb", mem,
                                                          low=1e-3)) * 2**30,
                   backend, tuple(layouts), tuple(precisions), diloco, sync, **trial)


def _replicate(value: Any) -> tuple[bool, DiLoCoConfig | None]:
    """``plan.replicate`` -> (sync allowed, DiLoCo's (every, compress) if allowed)."""
    if isinstance(value, list):
        if not value or set(value) - set(REPLICATE_MODES):
            raise PlanError(f"plan.replicate: {brief(value)}; give a list from sync, diloco, or a "
                            "mapping {every: 50, compress: int8} (sync + DiLoCo so set)")
        return "sync" in value, DiLoCoConfig() if "diloco" in value else None
    return True, _diloco(value)


def _diloco(value: Any) -> DiLoCoConfig | None:
    """``plan.replicate: {every: H, compress: none|bf16|int8}`` -> DiLoCo's settings."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - {"every", "compress", "mode"}:
        raise PlanError(f"plan.replicate: {brief(value)}; give {{every: 50, compress: int8}} to "
                        "also rank DiLoCo layouts (compress: none, bf16 or int8)")
    if value.get("mode", "diloco") != "diloco":
        raise PlanError("plan.replicate.mode: only diloco (sync layouts are always ranked)")
    every = int(_number("plan.replicate", "every", value.get("every", 50), low=1, integer=True))
    compress = value.get("compress", "none")
    if compress not in ("none", "bf16", "int8"):
        raise PlanError(f"plan.replicate.compress: {brief(compress)}; use none, bf16 or int8")
    return DiLoCoConfig(every=every, compress=compress)


def _model_stats(value: Any, load_factory: Callable[[str], Callable[..., Any]],
                 config: Mapping[str, Any]) -> ModelStats:
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"params", "layers", "hidden", "heads"})
        if unknown:
            raise PlanError(f"plan.model: unknown key(s) {unknown}; give params, layers, "
                            "hidden and heads")
        try:
            return ModelStats(**{k: value[k] for k in value})
        except TypeError as exc:
            raise PlanError(f"plan.model: {exc}; give params, layers, hidden (heads optional)") \
                from None
    if isinstance(value, str):
        import torch

        factory = load_factory(value)
        with torch.device("meta"):  # sizes only: no memory, no init time
            try:
                module = factory(dict(config))
            except TypeError:
                module = factory()
        return ModelStats.from_module(module, heads=config.get("heads"))
    raise PlanError(f"plan.model: {brief(value)}; give a mapping {{params, layers, hidden, heads}} "
                    "or a 'file.py:function' that builds the model from the job's config")
