"""``mesh="auto"`` with ``plan.step``: pick the layout by timing it (controller side).

The workers join the world process group and time the job's step on each candidate mesh
(:func:`ray_mesh.raytrain.worker_setup.trial_on_worker` -> :mod:`ray_mesh.planning.trial`),
in the order the cost model ranks them; the controller picks the measured fastest, logs the
predicted and measured table, and the bring-up goes on to build the picked mesh on the same
process group. The wait is bounded by the trial budget plus the bring-up timeout, and names
what to do past it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ray_mesh.planning.cost import Prediction
from ray_mesh.planning.inputs import PlanInputs
from ray_mesh.planning.trial import Trial, best_trial, format_trials
from ray_mesh.raytrain.bounded import BringUpError, wait_bounded
from ray_mesh.raytrain.links import Pick, pick_from
from ray_mesh.raytrain.worker_setup import WorkerSetup, trial_on_worker


def trial_pick(worker_group, setups: Sequence[WorkerSetup], ranked: list[Prediction],
               plan: PlanInputs, bringup_timeout_s: float) -> tuple[Pick, list[Trial]]:
    """Time every ranked layout on the workers; the :class:`Pick` of the measured fastest."""
    layouts = [p.layout for p in ranked]
    print(f"ray_mesh: mesh=auto timing the job's step (plan.step) on {len(layouts)} "
          f"candidate layout(s), at most ~{plan.trial_budget_s:.0f} s", flush=True)
    refs = [worker_group.execute_single_async(i, trial_on_worker, w, layouts, plan.step,
                                              plan.step_config, plan.trial_steps,
                                              plan.trial_budget_s)
            for i, w in enumerate(setups)]
    fix = (f"A step slower than the budget, or a step that waits on a collective some ranks "
           f"never call (plan.step must do the same collectives on every rank). Raise "
           f"plan.trial_budget_s (now {plan.trial_budget_s:g} s), lower plan.trial_steps, or "
           f"leave plan.step out to pick by prediction alone.")
    results = wait_bounded(refs, plan.trial_budget_s + bringup_timeout_s,
                           "mesh=auto's trial steps", [f"rank {w.rank}" for w in setups], fix)
    trials = [Trial.from_json(t) for t in results[0]]
    best = best_trial(trials)
    predicted = {str(p.layout): p.step_s for p in ranked}
    table = format_trials(trials, predicted)
    if best is None:
        raise BringUpError(f"mesh=auto: no candidate layout ran a timed step within "
                           f"plan.trial_budget_s={plan.trial_budget_s:g} s:\n{table}\nRaise the "
                           "budget, or leave plan.step out to pick by prediction alone.")
    chosen = next(p for p in ranked if str(p.layout) == best.layout)
    runner_up = best_trial([t for t in trials if t.layout != best.layout])
    why = (f"picked {best.layout}: measured fastest, "
           f"{best.median_s:.3g} s/step (median of {len(best.step_s)} trial steps)")
    if runner_up is not None:
        why += f" vs {runner_up.layout} {runner_up.median_s:.3g} s/step"
    if chosen is not ranked[0]:
        why += (f"; the cost model's first choice was {ranked[0].layout} "
                f"(predicted {ranked[0].step_s:.3g} s/step)")
    # The controller's stdout reaches the driver's console; its log file does not.
    print(f"ray_mesh: mesh=auto trials (predicted: the cost model; measured: the slowest "
          f"rank's step):\n{table}", flush=True)
    return pick_from(chosen, why), trials
