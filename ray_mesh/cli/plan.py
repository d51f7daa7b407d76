"""``ray-mesh plan JOB.yaml``: every layout of the job ranked by predicted step time.

The cluster's shape comes from ``--nodes``/``--per-node``; the link rate from
``--link-mbit`` or the job's ``plan.link_mbit``. Planning a job starts nothing and, unless
asked, imports nothing of the user's: a ``plan.model`` or ``plan.step`` given as
``file.py:function`` is Python that runs when imported, and reading a plan should not run
it. ``--import-code`` imports them (the model is built on the meta device to count its
parameters; the step factory is only loaded, to check it is a function). Without it, the
references are checked for form only, a model factory is refused with the alternative (its
size as a mapping), and the output says what was not imported.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_mesh.core.spec import load_yaml
from ray_mesh.planning.cost import Links, PlanError, explain_pick, format_ranked
from ray_mesh.planning.inputs import PlanInputs


class NotImported:
    """A ``file.py:function`` reference left unimported (``ray-mesh plan`` without
    ``--import-code``): callable, so the plan's checks pass, but calling it says why not."""

    def __init__(self, key: str, ref: str) -> None:
        self.key, self.ref = key, ref

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PlanError(
            f"plan.{self.key}: {self.ref!r} is code of yours that `ray-mesh plan` does not "
            f"import unless asked (importing runs the file): pass --import-code to build the "
            f"model on the meta device and count its parameters, or give plan.{self.key} as "
            f"a mapping {{params, layers, hidden, heads}}")

    def __repr__(self) -> str:
        return f"{self.ref} (not imported)"


def _loader(base: Path, import_code: bool, refs: list[str]
            ) -> Callable[[str, str], Callable[..., Any]]:
    from ray_mesh.cli.job import load_function
    from ray_mesh.cli.job_checks import check_train_ref

    def load(key: str, ref: str) -> Callable[..., Any]:
        refs.append(f"plan.{key} ({ref})")
        if import_code:
            return load_function(ref, base)
        check_train_ref(ref)  # the form only: nothing is opened or run
        return NotImported(key, ref)

    return load


def plan_inputs(job_path: str, import_code: bool = False,
                refs: list[str] | None = None) -> PlanInputs:
    """The ``plan:`` section of a job file; its ``file.py:function`` references (listed in
    ``refs``) imported only with ``import_code``."""
    data = load_yaml(job_path)
    if not isinstance(data, dict) or "plan" not in data:
        raise PlanError(f"{job_path}: no plan: section; add one (model, tokens_per_step, "
                        "compute_s) to plan this job's layouts")
    plan = data["plan"]
    load = _loader(Path(job_path).resolve().parent, import_code,
                   refs if refs is not None else [])
    model = plan.get("model") if isinstance(plan, dict) else None

    def load_factory(ref: str) -> Callable[..., Any]:  # the model's ref, or the step's
        return load("model" if ref == model else "step", ref)

    return PlanInputs.from_dict(plan, load_factory, data.get("config") or {})


def unequal_nodes(args: argparse.Namespace) -> list[int] | None:
    """Each node's workers when they differ or have speeds (plan replica groups), else None
    (``args.per_node`` becomes the one count a uniform mesh plans with)."""
    per, speeds = args.per_node, getattr(args, "node_speed", None)
    if per is None or (len(per) == 1 and not speeds):
        args.per_node = per[0] if per else None
        return None
    if len(per) == 1:
        per = per * (args.nodes or len(speeds))
    if args.nodes is not None and args.nodes != len(per):
        raise PlanError(f"--nodes {args.nodes} but --per-node lists {len(per)} node(s): give "
                        "one count per node, or drop --nodes")
    return per


def run_groups(args: argparse.Namespace, inputs: PlanInputs, per_node: list[int]) -> int:
    """Unequal nodes: one replica group per node, shares by speed (planning.groups)."""
    from ray_mesh.planning.groups import plan_groups

    speeds = args.node_speed or [1.0] * len(per_node)
    mbit = args.link_mbit or inputs.link_mbit
    if mbit is None:
        raise PlanError("no link rate: give --link-mbit, or plan.link_mbit in the job "
                        "(`ray-mesh doctor` measures the links of a live cluster)")
    every = inputs.diloco.every if inputs.diloco is not None and not inputs.sync else 1
    plan = plan_groups(per_node, speeds, inputs.stats, inputs.work, float(mbit),
                       inputs.latency_s, every)
    if args.json:
        print(json.dumps({"groups": [vars(s) for s in plan.shares], "step_s": plan.step_s,
                          "compute_s": plan.compute_s, "exchange_s": plan.exchange_s,
                          "equal_step_s": plan.equal_step_s,
                          "leave_out_step_s": plan.leave_out_step_s,
                          "left_out": plan.left_out}, indent=2))
        return 0
    print(f"{len(per_node)} node(s) with {', '.join(map(str, per_node))} worker(s), node link "
          f"{float(mbit):g} Mbit/s, {inputs.stats.params:,} parameters")
    print("\n".join(plan.lines()))
    print("run it with fit_replica_groups(groups='auto', shares='speed'): one group per node, "
          "each node's speed measured in the run's first steps")
    print("note: ray-mesh plan started no Ray and ran no step")
    return 0


def links_for(args: argparse.Namespace, inputs: PlanInputs) -> Links:
    nodes, per_node = args.nodes, args.per_node
    if nodes is None or per_node is None:
        raise PlanError("give the cluster's shape with --nodes N --per-node G (workers per "
                        "node): planning a job file reads no live cluster")
    mbit = args.link_mbit or inputs.link_mbit
    if mbit is None:
        raise PlanError("no link rate: give --link-mbit, or plan.link_mbit in the job "
                        "(`ray-mesh doctor` measures the links of a live cluster)")
    return Links(nodes, per_node, float(mbit), latency_s=inputs.latency_s,
                 backend=inputs.backend or "gloo")


def run(args: argparse.Namespace) -> int:
    refs: list[str] = []
    import_code = bool(getattr(args, "import_code", False))
    inputs = plan_inputs(args.job, import_code, refs)
    per_node = unequal_nodes(args)
    if per_node is not None:
        return run_groups(args, inputs, per_node)
    links = links_for(args, inputs)
    ranked = inputs.rank(links)
    if args.json:
        print(json.dumps({"links": {"nodes": links.nodes, "per_node": links.per_node,
                                    "cross_mbit": links.cross_mbit},
                          "layouts": [p.to_json() for p in ranked],
                          "pick": ranked[0].to_json(),
                          "imported" if import_code else "not_imported": refs}, indent=2))
        return 0
    print(f"{links.nodes} node(s) x {links.per_node} worker(s), node link "
          f"{links.cross_mbit:g} Mbit/s, {inputs.stats.params:,} parameters")
    print(format_ranked(ranked))
    print(explain_pick(ranked))
    if inputs.step is not None:
        print(f"mesh: auto times plan.step on these {len(ranked)} layouts at bring-up (in "
              f"this order, {inputs.trial_steps} steps each, at most "
              f"~{inputs.trial_budget_s:g} s) and builds the measured fastest")
    if not refs:
        code = "imported no code of yours"
    elif import_code:
        code = f"imported {', '.join(refs)} (--import-code)"
    else:
        code = (f"did not import {', '.join(refs)} (pass --import-code to import and check "
                f"it)")
    print(f"note: ray-mesh plan started no Ray, ran no step and {code}")
    return 0
