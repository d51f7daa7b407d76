"""The ``ray-mesh`` command: ``ray-mesh run JOB.yaml [--address ADDR]``."""

from __future__ import annotations

import argparse
import logging
import sys

from ray_mesh.job import Job, JobError
from ray_mesh.spec import MeshSpecError
from ray_mesh.topology import TopologyError

USER_ERRORS = (JobError, MeshSpecError, TopologyError)


def _cmd_run(args: argparse.Namespace) -> int:
    from ray_mesh.runner import run_job

    job = Job.from_yaml(args.job)
    if args.num_workers is not None:
        job.scaling["num_workers"] = args.num_workers
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
    from ray_mesh.status import StatusError, collect, format_status

    try:
        status = collect(args.address, timeout_s=args.timeout, all_runs=args.all)
    except StatusError as exc:
        print(f"ray-mesh: error: {exc}", file=sys.stderr)
        return 2
    print(format_status(status))
    return 0


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
    status.set_defaults(func=_cmd_status)
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
