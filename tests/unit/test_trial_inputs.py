"""``plan.step`` and its trial settings: parsed and checked on the driver, each bad value
named with its fix; the job file carries the step and the job's config to the trials; the
trial table and the pick from it (pure logic; the trials themselves run in
tests/dist/test_trial.py and, under Ray, tests/ray/test_mesh_auto_trial.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ray_mesh.planning.cost import PlanError
from ray_mesh.planning.inputs import PlanInputs
from ray_mesh.planning.trial import BUDGET, CUT, TIMED, Trial, best_trial, format_trials

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": {"params": 1000, "layers": 2, "hidden": 16}, "tokens_per_step": 64,
        "compute_s": 0.5}


def _step(mesh, config):
    return lambda: None


def _load(ref: str):
    assert ref == "job.py:make_step", ref
    return _step


def test_a_step_ref_is_loaded_with_the_jobs_config_and_the_trial_settings():
    plan = PlanInputs.from_dict({**BASE, "step": "job.py:make_step", "trial_steps": 2,
                                 "trial_budget_s": 30}, _load, {"lr": 0.1})
    assert plan.step is _step and plan.step_config == {"lr": 0.1}
    assert (plan.trial_steps, plan.trial_budget_s) == (2, 30)
    plain = PlanInputs.from_dict(BASE, _load)
    assert plain.step is None and (plain.trial_steps, plain.trial_budget_s) == (3, 120.0)


@pytest.mark.parametrize("extra, match", [
    ({"step": 5}, "plan.step: 5; give 'file.py:make_step'"),
    ({"step": "job.py:make_step", "trial_steps": 0}, r"plan.trial_steps: 0; give an integer"),
    ({"step": "job.py:make_step", "trial_steps": "3"}, "plan.trial_steps"),
    ({"step": "job.py:make_step", "trial_steps": True}, "plan.trial_steps"),
    ({"step": "job.py:make_step", "trial_budget_s": 0}, r"plan.trial_budget_s: 0; give seconds"),
    ({"step": "job.py:make_step", "trial_budget_s": -5}, "plan.trial_budget_s"),
    ({"step": "job.py:make_step", "replicate": ["sync", "diloco"]},
     r"plan.step times sync layouts only.*plan.replicate: \[sync\]"),
])
def test_bad_trial_settings_are_named_on_the_driver(extra, match):
    with pytest.raises(PlanError, match=match):
        PlanInputs.from_dict({**BASE, **extra}, _load)


def test_a_step_that_is_not_a_function_is_refused_in_python_too():
    plan = PlanInputs.from_dict(BASE, _load)
    with pytest.raises(PlanError, match="plan.step: 'make_step' is not a function"):
        PlanInputs(plan.stats, plan.work, step="make_step")


def test_the_fastest_median_wins_and_the_table_says_how_each_trial_ended():
    ddp, hsdp = "dp_replicate=4/fp32/sync", "dp_replicate=2,dp_shard=2/fp32/sync"
    trials = [Trial(ddp, CUT, [0.9]),
              Trial(hsdp, TIMED, [0.30, 0.20, 0.25]),
              Trial("dp_shard=4/fp32/sync", TIMED, [0.22, 0.40, 0.26]),
              Trial("dp_replicate=2,tp=2/fp32/sync", BUDGET, [])]
    best = best_trial(trials)
    assert best is not None and best.layout == hsdp and best.median_s == 0.25
    assert best_trial([trials[-1]]) is None  # no timed step: nothing to pick
    table = format_trials(trials, {ddp: 0.1, hsdp: 0.3})
    rows = table.splitlines()
    assert rows[0].split() == ["layout", "predicted", "measured", "trial"]
    assert "stopped after 1 (slower than the best)" in rows[1] and "0.1 s" in rows[1]
    assert "0.25 s" in rows[2] and "median of 3" in rows[2]
    assert rows[3].split()[1] == "-"  # not predicted
    assert "budget spent (0 timed)" in rows[4]
    assert Trial.from_json(trials[1].to_json()) == trials[1]


def test_the_lm_auto_job_carries_its_step_and_plan_prints_that_it_will_time_it(capsys):
    from ray_mesh.cli.job import Job
    from ray_mesh.cli.main import main

    job = Job.from_yaml(ROOT / "examples" / "llm_auto.yaml")
    assert job.mesh == "auto" and job.plan.step.__name__ == "make_step"
    assert job.plan.step_config["model"]["preset"] == "small"  # the job's config: section
    assert main(["plan", str(ROOT / "examples" / "llm_auto.yaml"), "--nodes", "2",
                 "--per-node", "2", "--link-mbit", "100", "--import-code"]) == 0
    out = capsys.readouterr().out
    assert "mesh: auto times plan.step on these 7 layouts at bring-up" in out, out
