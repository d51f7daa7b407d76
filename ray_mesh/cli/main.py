"""The ``ray-mesh`` command: ``ray-mesh run JOB.yaml [--address ADDR]``.

Also ``ray-mesh plan [--address ADDR] [--strategy S]`` (the mesh and rank -> node table
proposed for the live cluster) and ``ray-mesh doctor [--address ADDR]`` (the network
pre-flight on every live node).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ray_mesh.cli.job import Job, JobError
from ray_mesh.core.spec import MeshSpecError
from ray_mesh.core.topology import TopologyError
from ray_mesh.network.interfaces import NetworkError
from ray_mesh.planning.cost import PlanError

USER_ERRORS = (JobError, MeshSpecError, TopologyError, NetworkError, PlanError)


def _cmd_run(args: argparse.Namespace) -> int:
    from ray_mesh.raytrain.runner import run_job

    job = Job.from_yaml(args.job)
    if args.num_workers is not None:
        job = job.with_num_workers(args.num_workers)
    result = run_job(job, address=args.address)
    if result.error is not None:
        print(f"ray-mesh: the run failed: {result.error}", file=sys.stderr)
        return 1
    print(f"ray-mesh: run {job.name!r} finished; results in {result.path}")
    if result.metrics:
        print("ray-mesh: last metrics: " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in result.metrics.items()))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from ray_mesh.observability.status import StatusError, collect, format_status

    try:
        status = collect(args.address, timeout_s=args.timeout, all_runs=args.all)
    except StatusError as exc:
        print(f"ray-mesh: error: {exc}", file=sys.stderr)
        return 2
    print(format_status(status))
    if args.html:
        from ray_mesh.observability.html import write_html

        print(f"ray-mesh: wrote {write_html(args.html, status)}")
    return 0


def _connect_existing(address: str | None) -> None:
    """Join a running cluster (never start one: plan and doctor describe a real cluster)."""
    import os

    from ray_mesh.raytrain.runner import connect

    connect(address or os.environ.get("RAY_ADDRESS") or "auto", 0)


def _cmd_plan(args: argparse.Namespace) -> int:
    from ray_mesh.planning.cluster import describe_nodes, plan_cluster
    from ray_mesh.raytrain.cluster import live_nodes

    if args.job:
        from ray_mesh.cli import plan

        return plan.run(args)

    _connect_existing(args.address)
    nodes = live_nodes()
    resource = args.resource or ("GPU" if any(n.gpus for n in nodes) else "CPU")
    print(describe_nodes(nodes, resource))
    print()
    print(plan_cluster(nodes, args.strategy, resource=resource, tp=args.tp,
                       pp=args.pp).format())
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ray_mesh.planning.cluster import describe_nodes
    from ray_mesh.raytrain.cluster import doctor, live_nodes

    _connect_existing(args.address)
    nodes = live_nodes()
    print(describe_nodes(nodes, "GPU"))
    print()
    report = doctor(nodes, interface=args.interface, timeout_s=args.timeout,
                    rendezvous_port=args.port)
    print(report.format())
    return 0 if report.ok else 1


def _add_plan_doctor(sub) -> None:
    from ray_mesh.network.report import DEFAULT_TIMEOUT_S
    from ray_mesh.planning.cluster import STRATEGIES

    address_help = "Ray cluster address (else RAY_ADDRESS, else the cluster on this machine)"
    plan = sub.add_parser("plan", help="propose a mesh and rank -> node table for the cluster")
    plan.add_argument("--address", default=None, help=address_help)
    plan.add_argument("--strategy", choices=STRATEGIES, default="hsdp",
                      help="hsdp (default), tp-dp, tp-pp or pp-hsdp-tp")
    plan.add_argument("--resource", default=None,
                      help="what one worker takes (default GPU if the cluster has GPUs, else "
                           "CPU; or a custom resource name)")
    plan.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    plan.add_argument("--pp", type=int, default=None, help="pipeline-parallel size")
    plan.add_argument("job", nargs="?", default=None,
                      help="a job file with a plan: section: rank every layout by predicted "
                           "step time")
    plan.add_argument("--nodes", type=int, default=None, help="with JOB: number of nodes")
    plan.add_argument("--per-node", type=int, default=None, help="with JOB: workers per node")
    plan.add_argument("--link-mbit", type=float, default=None,
                      help="with JOB: node link rate in Mbit/s (else plan.link_mbit)")
    plan.add_argument("--json", action="store_true", help="with JOB: machine-readable output")
    plan.set_defaults(func=_cmd_plan)

    doc = sub.add_parser("doctor", help="check interfaces, versions and connectivity of "
                                        "every live node (bounded)")
    doc.add_argument("--address", default=None, help=address_help)
    doc.add_argument("--interface", default="auto",
                     help="'auto' (default) or an interface name to check on every node")
    doc.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                     help=f"bound on the whole check in seconds (default {DEFAULT_TIMEOUT_S:g})")
    doc.add_argument("--port", type=int, default=None,
                     help="also check this fixed rendezvous port (MASTER_PORT) on the head")
    doc.set_defaults(func=_cmd_doctor)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-mesh", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a YAML job (embedded local Ray without --address)")
    run.add_argument("job", help="path to the job's YAML file")
    run.add_argument("--address", default=None,
                     help="Ray cluster address (else RAY_ADDRESS, else an embedded local Ray)")
    run.add_argument("--num-workers", type=int, default=None,
                     help="override scaling.num_workers")
    run.set_defaults(func=_cmd_run)
    status = sub.add_parser("status", help="nodes, running ray_mesh runs, layout, metrics")
    status.add_argument("--address", default=None,
                        help="GCS address (<head>:6379) or dashboard URL (http://<head>:8265);"
                             " else RAY_ADDRESS, else the local dashboard")
    status.add_argument("--all", action="store_true", help="include finished runs")
    status.add_argument("--timeout", type=float, default=5.0,
                        help="seconds to wait for each answer (default 5)")
    status.add_argument("--html", default=None, metavar="FILE",
                        help="also draw nodes, ranks, links and curves into a self-contained "
                             "HTML file (rendering into it again extends the curves)")
    status.set_defaults(func=_cmd_status)
    _add_plan_doctor(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"ray-mesh: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
