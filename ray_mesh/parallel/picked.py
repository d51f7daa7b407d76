"""The layout ``mesh="auto"`` picked, as the train function's helpers see it.

With ``MeshConfig(mesh="auto", plan=...)`` the backend ranks the layouts the plan allows
(families x gradient precisions x replicate modes) and sets the pick on every worker before
the train function starts. The helpers a train function already calls read it, so the
function follows the pick without a code change:

- :func:`ray_mesh.parallel.parallelize` / :func:`~ray_mesh.parallel.apply_fsdp` with
  ``mixed_precision`` left unset reduce gradients in the picked dtype
  (:func:`picked_precision`); an explicit ``mixed_precision`` (``"fp32"`` too) wins;
- the replicate mode goes through :func:`ray_mesh.parallel.replicate.set_replicate_config`,
  so ``replicate_config()``, ``dp_mode()`` and ``wrap_replicate()`` see DiLoCo when it was
  picked.

:func:`picked_plan` tells the train function what was picked and why (for its own logs).
Ray-free; outside ``mesh="auto"`` nothing is set and everything is as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray_mesh.errors import ParallelError


@dataclass(frozen=True)
class PickedPlan:
    """What ``mesh="auto"`` chose: the layout's label and mesh, precision, replicate mode."""

    layout: str
    mesh: dict[str, int] = field(default_factory=dict)
    precision: str = "fp32"  # or "bf16_grads"
    replicate: str = "sync"  # or "diloco"
    why: str = ""


_current: PickedPlan | None = None


def set_picked_plan(plan: PickedPlan | None) -> None:
    """Set this process's pick (the Ray backend does it on every worker; None: no pick)."""
    global _current
    if plan is not None and not isinstance(plan, PickedPlan):
        raise ParallelError(f"set_picked_plan takes a PickedPlan or None, not {plan!r}")
    _current = plan


def picked_plan() -> PickedPlan | None:
    """The pick of ``mesh="auto"`` in this run, or None (a fixed mesh)."""
    return _current


def picked_precision() -> str | None:
    """``"bf16_grads"`` when the pick reduces gradients in bf16, else None (fp32)."""
    return _current.precision if _current and _current.precision != "fp32" else None


__all__ = ["PickedPlan", "picked_plan", "picked_precision", "set_picked_plan"]
