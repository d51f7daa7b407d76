"""Trial steps: the job's own step, timed on each candidate mesh of the live cluster.

The cost model (:mod:`ray_mesh.planning.cost`) ranks layouts from one ``compute_s`` and the
link rate; on CPU, on small models and on shared cores what a step costs beyond its
arithmetic is mostly fixed per call and per byte on the host, which no analytic model sees:
at 1 Gbit/s on the 2-node virtual cluster it ranked first a layout 1.3-2.3x slower than the
fastest in five of eight runs (``benchmarks/RESULTS.md``, slowlinks). The calibrated model
(``benchmarks/planning_lab/calibrate.py``, the benchmarks' laboratory) is mostly within 15%,
but needs each layout's one-node shape run with the job's step. What a user can give is the
step itself, so ``mesh="auto"`` with ``plan.step`` runs it: every candidate, in the order
the model predicts, builds its mesh, runs one warm-up step and up to ``steps`` timed steps,
then frees the mesh's groups.

Bounded: the trials stop starting layouts once ``budget_s`` has passed (a layout under way
stops after the step that crosses it), and a layout whose fastest step is already slower
than ``cut`` x the best median so far stops at once: it cannot win, so a slow layout costs
one warm-up and one step. Every decision reads figures all-reduced (MAX) over the ranks, so
every rank takes the same branch and the collectives stay matched.

A collective: every rank of the world group calls :func:`run_trials` with the same layouts;
torch only (no Ray), usable under torchrun.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_mesh.core.layout import Layout
from ray_mesh.errors import PlanError, TrialError

StepFactory = Callable[[Any, dict], Callable[[], Any]]  # (DeviceMesh, config) -> step()

TIMED, CUT, BUDGET = "timed", "cut", "budget"


@dataclass(frozen=True)
class Trial:
    """One candidate's trial: its timed steps (each the slowest rank's) and how it ended:
    ``timed`` (all its steps), ``cut`` (slower than the best so far: stopped) or
    ``budget`` (the time budget ran out before or during it)."""

    layout: str  # the canonical string of its Layout
    status: str
    step_s: list[float] = field(default_factory=list)
    warmup_s: float = 0.0

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_s) if self.step_s else None

    def to_json(self) -> dict[str, Any]:
        return {"layout": self.layout, "status": self.status,
                "step_s": list(self.step_s), "warmup_s": self.warmup_s,
                "median_s": self.median_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Trial:
        return cls(data["layout"], data["status"], list(data["step_s"]),
                   float(data.get("warmup_s", 0.0)))


def check_trial_settings(steps: Any, budget_s: Any, cut: Any = 1.2) -> None:
    """Bad ``plan.trial_steps`` / ``plan.trial_budget_s`` named on the driver."""
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= 100:
        raise PlanError(f"plan.trial_steps: {steps!r}; give an integer in [1, 100] (timed "
                        "steps per candidate layout, after one warm-up step)")
    if (isinstance(budget_s, bool) or not isinstance(budget_s, int | float)
            or not 0 < budget_s <= 3600):
        raise PlanError(f"plan.trial_budget_s: {budget_s!r}; give seconds in (0, 3600] (the "
                        "trials stop starting layouts past it)")
    if isinstance(cut, bool) or not isinstance(cut, int | float) or not 1 <= cut <= 10:
        raise PlanError(f"trial cut {cut!r}: give a factor in [1, 10]")


def best_trial(trials: Sequence[Trial]) -> Trial | None:
    """The trial with the lowest median step (None: no layout ran a timed step)."""
    timed = [t for t in trials if t.step_s]
    return min(timed, key=lambda t: t.median_s or 0.0) if timed else None


def format_trials(trials: Sequence[Trial], predicted: dict[str, float] | None = None) -> str:
    """A table: layout, predicted and measured seconds per step, how its trial ended."""
    predicted = predicted or {}
    width = max([len("layout"), *(len(t.layout) for t in trials)])
    lines = [f"{'layout':<{width}} {'predicted':>10} {'measured':>10}  trial"]
    for t in trials:
        pred = predicted.get(t.layout)
        med = t.median_s
        how = {TIMED: f"median of {len(t.step_s)}",
               CUT: f"stopped after {len(t.step_s)} (slower than the best)",
               BUDGET: f"budget spent ({len(t.step_s)} timed)"}[t.status]
        lines.append(f"{t.layout:<{width}} {'-' if pred is None else f'{pred:.3g} s':>10} "
                     f"{'-' if med is None else f'{med:.3g} s':>10}  {how}")
    return "\n".join(lines)


def _max_everywhere(values: list[float], device: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _synchronize(device: Any) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def _free(mesh: Any) -> None:
    """Destroy the trial mesh's own groups (never the world group): NCCL communicators hold
    device memory, gloo groups threads; ten candidates would keep them all otherwise."""
    import torch.distributed as dist

    import ray_mesh.private_apis as private_apis

    gc.collect()  # the model and optimizer of the step, and the DTensors that hold the mesh
    world = dist.group.WORLD
    for group in private_apis.release_mesh_groups(mesh):
        if group is not world:
            dist.destroy_process_group(group)
    if mesh.device_type == "cuda":  # the trial model's blocks back to the device
        import torch

        torch.cuda.empty_cache()


def run_trials(layouts: Sequence[Layout], make_step: StepFactory, config: dict | None = None,
               *, steps: int = 3, budget_s: float = 120.0, cut: float = 1.2,
               device_type: str = "cpu", log: Callable[[str], None] | None = None
               ) -> list[Trial]:
    """Time ``make_step(mesh, config)`` on every layout's mesh; the same list on every rank.

    ``make_step`` builds the job's model on the mesh it is given (``parallelize`` with
    ``mixed_precision`` unset follows each layout's gradient precision: the trial's mesh
    carries its layout, and nothing of the process is changed) and returns a function that
    runs one training step on a fixed batch. ``log`` (rank 0's printer, or None) gets one
    line per layout.
    """
    import torch
    import torch.distributed as dist

    from ray_mesh.core.bootstrap import build_device_mesh

    check_trial_settings(steps, budget_s, cut)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device("cpu"))
    start = time.perf_counter()
    trials: list[Trial] = []
    best: float | None = None
    for i, lay in enumerate(layouts):
        if _max_everywhere([time.perf_counter() - start], device)[0] > budget_s:
            trials.append(Trial(str(lay), BUDGET))
            continue
        if lay.diloco:
            raise PlanError(f"trial of {lay}: DiLoCo's outer sync every "
                            f"{lay.diloco.every} steps is not in a few trial steps; trials "
                            "time sync layouts only (plan.replicate: [sync])")
        mesh = build_device_mesh(lay.mesh.resolve(world), device_type, layout=lay)
        status, times, warm = TIMED, [], 0.0
        try:
            t0 = time.perf_counter()
            step = make_step(mesh, dict(config or {}))
            if not callable(step):
                raise TypeError(f"it returned {type(step).__name__}, not a function to call "
                                "once per training step")
            step()  # lazy init, first all-gathers: not timed as a step
            _synchronize(device)
            warm = _max_everywhere([time.perf_counter() - t0], device)[0]
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                _synchronize(device)
                took, elapsed = _max_everywhere([time.perf_counter() - t0,
                                                 time.perf_counter() - start], device)
                times.append(took)
                if best is not None and min(times) > cut * best:
                    status = CUT
                    break
                if elapsed > budget_s:
                    status = BUDGET
                    break
        except Exception as exc:
            raise TrialError(f"mesh=auto: the job's step (plan.step) failed on layout "
                             f"{lay} on rank {rank}: "
                             f"{type(exc).__name__}: {exc}. Fix the step for that mesh, or "
                             "leave the layout's family out of plan.layouts") from exc
        finally:
            step = None  # noqa: F841 - the model goes with it, before its groups
            _free(mesh)
        trial = Trial(str(lay), status, times, warm)
        trials.append(trial)
        if trial.median_s is not None and status != CUT:
            best = trial.median_s if best is None else min(best, trial.median_s)
        if log is not None:
            med = trial.median_s
            log(f"ray_mesh: mesh=auto trial {i + 1}/{len(layouts)} {lay}: "
                f"{'-' if med is None else f'{med:.3g} s/step'} "
                f"({len(times)} timed, {status}; warm-up {warm:.2g} s)")
    return trials
