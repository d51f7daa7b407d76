"""``ray-mesh plan JOB.yaml``: every layout of the job ranked by predicted step time.

The cluster's shape comes from ``--nodes``/``--per-node`` or the live cluster; the link
rate from ``--link-mbit``, the job's ``plan.link_mbit``, or a measurement on the live
cluster (``ray-mesh doctor`` measures the same way).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ray_mesh.core.spec import load_yaml
from ray_mesh.planning.cost import Links, PlanError, explain_pick, format_ranked
from ray_mesh.planning.inputs import PlanInputs


def plan_inputs(job_path: str) -> PlanInputs:
    """The ``plan:`` section of a job file, model factory resolved next to the file."""
    from ray_mesh.cli.job import load_function

    data = load_yaml(job_path)
    if not isinstance(data, dict) or "plan" not in data:
        raise PlanError(f"{job_path}: no plan: section; add one (model, tokens_per_step, "
                        "compute_s) to plan this job's layouts")
    base = Path(job_path).resolve().parent
    return PlanInputs.from_dict(data["plan"], lambda ref: load_function(ref, base),
                                data.get("config") or {})


def links_for(args: argparse.Namespace, inputs: PlanInputs) -> Links:
    nodes, per_node = args.nodes, args.per_node
    if nodes is None or per_node is None:
        raise PlanError("give the cluster's shape with --nodes N --per-node G (workers per "
                        "node), or run against a live cluster with --address")
    mbit = args.link_mbit or inputs.link_mbit
    if mbit is None:
        raise PlanError("no link rate: give --link-mbit, plan.link_mbit in the job, or run "
                        "against a live cluster with --address to measure it")
    return Links(nodes, per_node, float(mbit), latency_s=inputs.latency_s,
                 backend=inputs.backend or "gloo")


def run(args: argparse.Namespace) -> int:
    inputs = plan_inputs(args.job)
    links = links_for(args, inputs)
    ranked = inputs.rank(links)
    if args.json:
        print(json.dumps({"links": {"nodes": links.nodes, "per_node": links.per_node,
                                    "cross_mbit": links.cross_mbit},
                          "layouts": [p.to_json() for p in ranked],
                          "pick": ranked[0].to_json()}, indent=2))
    else:
        print(f"{links.nodes} node(s) x {links.per_node} worker(s), node link "
              f"{links.cross_mbit:g} Mbit/s, {inputs.stats.params:,} parameters")
        print(format_ranked(ranked))
        print(explain_pick(ranked))
        if inputs.step is not None:
            print(f"mesh: auto times plan.step on these {len(ranked)} layouts at bring-up (in "
                  f"this order, {inputs.trial_steps} steps each, at most "
                  f"~{inputs.trial_budget_s:g} s) and builds the measured fastest")
    return 0
