"""The ``ray-mesh`` command: ``ray-mesh run JOB.yaml [--address ADDR]``.

Also ``ray-mesh plan [--address ADDR] [--layout FAMILY]`` (the mesh and rank -> node table
proposed for the live cluster) and ``ray-mesh doctor [--address ADDR]`` (the network
pre-flight on every live node).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import traceback

from ray_mesh.cli.flags import (
    CliParser,
    address_flag,
    int_flag,
    list_flag,
    name_flag,
    port_flag,
    positive_number,
    seconds_flag,
    status_address_flag,
    storage_flag,
)
from ray_mesh.cli.job import MAX_WORKERS, Job
from ray_mesh.core.safe import safe_text
from ray_mesh.errors import TrainFunctionError, exit_code

# Help text is plain text (the module docstring is for readers of the code).
DESCRIPTION = """\
Train on a named torch DeviceMesh across a Ray cluster.

  ray-mesh run JOB.yaml [--address ADDR]   run a job (an embedded local Ray without --address)
  ray-mesh status [--address ADDR]         nodes, runs, layout, metrics, slow rank/link
  ray-mesh plan [--address ADDR]           the mesh and rank -> node table for the cluster
  ray-mesh doctor [--address ADDR]         network pre-flight on every live node

ADDR is the head's address and GCS port, e.g. 100.64.0.1:6379; RAY_ADDRESS works too."""

RUN_DESCRIPTION = """\
Run the YAML job file JOB: its train function on the mesh it names.

Without --address (and without RAY_ADDRESS) the job runs on an embedded local Ray that
stops when the job ends. The console shows the mesh layout, the interface each node uses,
a progress line every few steps and a summary at the end; add -v for every
rank's environment line and Ray Train's own log lines."""


# Ray's driver folds lines that differ only in numbers from several processes into one
# ("[repeated Nx across cluster]"); replica groups print one progress line per group, which
# differ only in the group's number. Read by Ray at import, so set before ray is imported.
PROGRESS_LINES = r"[\w.-]+: step \d+/\d+ "


def _cmd_run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_DEDUP_LOGS_ALLOW_REGEX", PROGRESS_LINES)  # never folded
    # Parsed once, the flags in: they go through the file's own checks, before Ray and torch
    # are imported (~3 s of CPU), so a job with a mistake is refused at once.
    job = Job.from_yaml(args.job, num_workers=args.num_workers, storage_path=args.storage_path,
                        storage_endpoint=args.storage_endpoint)
    from ray_mesh.cli.runner import run_job_outcome

    if job.replica_groups is not None:  # one Ray Train run per group
        from ray_mesh.cli.groups_runner import groups_summary, run_groups_outcome

        lines, ok = groups_summary(job.name, job.run.storage_path, run_groups_outcome(
            job, address=args.address, verbose=args.verbose))
        print("\n".join(lines), file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1
    try:
        outcome = run_job_outcome(job, address=args.address, verbose=args.verbose)
    except TrainFunctionError as exc:  # the user's code: the run failed, as a group's would
        if args.verbose:
            traceback.print_exc()
        print(f"ray-mesh: run {job.name!r} failed: {safe_text(exc, multiline=True)}",
              file=sys.stderr)
        return 1
    result = outcome.result
    if result.error is not None:
        print(f"ray-mesh: run {job.name!r} failed: {safe_text(result.error, multiline=True)}",
              file=sys.stderr)
        return 1
    print("\n".join(summary_lines(job.name, outcome)))
    return 0


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_lines(name: str, outcome) -> list[str]:
    """The final summary: steps, wall time, throughput, checkpoint, results, metrics."""
    result, metrics = outcome.result, outcome.metrics
    steps = metrics.get("step")
    wall = outcome.wall_s
    head = f"ray-mesh: run {name!r} finished"
    checkpoint = result.checkpoint.path if result.checkpoint is not None else "none saved"
    where = [f"  checkpoint:  {checkpoint}", f"  results:     {result.path}"]
    if not outcome.fresh:  # resumed where an earlier fit of this name and storage ended
        return [safe_text(line, 2000) for line in (
            f"{head} in {wall:.1f} s with nothing to train: it resumed from the checkpoint "
            f"of an earlier fit of the same name and storage path"
            + (f", at step {int(steps)}," if isinstance(steps, int | float) else "")
            + " and reported nothing. Another name (name:) or --storage-path trains afresh.",
            *where)]
    if isinstance(steps, int | float) and steps:
        # "at step N", not "N steps": a fit that Ray Train resumed from a checkpoint (a run
        # restarted after its driver died) trained only the steps after it in this time
        head += f" at step {int(steps)} in {wall:.1f} s (start-up included)"
    else:
        head += f" in {wall:.1f} s"
    lines = [head]
    rates = [f"{_number(metrics[k])} {unit}" for k, unit in (
        ("steps_per_s", "steps/s"), ("samples_per_s", "samples/s"),
        ("tokens_per_s", "tokens/s")) if k in metrics]
    if rates:
        # the recorder's rates span the first report to the last: an evaluation or a
        # checkpoint between two reports counts, the start-up before the first does not
        lines.append("  throughput:  " + ", ".join(rates)
                     + " (first report to last: start-up left out)")
    shown = {k: v for k, v in metrics.items()
             if k not in ("step", "steps_per_s", "samples_per_s", "tokens_per_s")}
    if shown:
        lines.append("  last report: " + ", ".join(f"{k}={_number(v)}" for k, v in shown.items()))
    lines += where
    if outcome.metrics_url and outcome.embedded:
        lines.append(f"  metrics:     were served at {outcome.metrics_url} while the embedded "
                     f"Ray ran (it stops with the job); run on a cluster (--address) to keep "
                     f"them for Prometheus and `ray-mesh status`")
    elif outcome.metrics_url:
        lines.append(f"  metrics:     {outcome.metrics_url} (Prometheus; series ray_mesh_*), "
                     f"or `ray-mesh status`")
    else:
        lines.append("  metrics:     none served (this Ray node opened no metrics port)")
    # Keys and values of the saved summary come from the run's storage: escaped, one line.
    return [safe_text(line, 2000) for line in lines]


def _cmd_status(args: argparse.Namespace) -> int:
    from ray_mesh.status.cluster import StatusError, collect, format_status

    try:
        status = collect(args.address, timeout_s=args.timeout, all_runs=args.all,
                         storage=args.storage or (), total_s=args.deadline,
                         storage_endpoint=args.storage_endpoint,
                         max_bytes=args.max_mb * 2**20)
    except StatusError as exc:
        print(f"ray-mesh: error: {safe_text(exc, multiline=True)}", file=sys.stderr)
        return 2
    if args.json:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(status), indent=1, default=str))
    else:
        print(format_status(status))
    if args.html:
        from ray_mesh.status.html import write_html

        print(f"ray-mesh: wrote {write_html(args.html, status)}")
    return 0


def _connect_existing(address: str | None) -> None:
    """Join a running cluster (never start one: plan and doctor describe a real cluster)."""
    import os

    from ray_mesh.cli.runner import connect

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
    print(safe_text(describe_nodes(nodes, resource), multiline=True))  # nodes' own words
    print()
    print(safe_text(plan_cluster(nodes, args.layout, resource=resource, tp=args.tp,
                                 pp=args.pp).format(), multiline=True))
    if sum(n.alive and n.amount(resource) >= 1 for n in nodes) > 1:  # unequal boxes too
        from ray_mesh.planning.groups import format_node_groups, groups_from_nodes

        rates = None
        if args.calibrate:
            from ray_mesh.raytrain.calibrate import node_speeds

            rates = node_speeds(nodes, use_gpu=resource == "GPU")
        print()
        print(safe_text(format_node_groups(groups_from_nodes(nodes, resource), rates),
                        multiline=True))
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ray_mesh.planning.cluster import describe_nodes
    from ray_mesh.raytrain.cluster import doctor, live_nodes

    _connect_existing(args.address)
    nodes = live_nodes()
    print(safe_text(describe_nodes(nodes, "GPU"), multiline=True))  # what the nodes report
    print()
    report, links, mtu = doctor(nodes, interface=args.interface, timeout_s=args.timeout,
                                rendezvous_port=args.port,
                                link_probe_s=None if args.no_links else args.link_probe)
    # A blackholed path fails the check: a collective over it hangs. A relayed link only
    # costs speed: it is named, not failed.
    ok = report.ok and not (mtu and mtu.blackholes())
    if args.json:
        print(json.dumps({"ok": ok, "problems": report.problems + (mtu.problems() if mtu else []),
                          "links": links.to_json() if links else [],
                          "verdict": links.verdict() if links else None,
                          "relayed": links.relay_hints(most=None) if links else [],
                          "links_error": links.error if links else "",
                          "path_mtu": mtu.to_json() if mtu else []}, indent=2))
        return 0 if ok else 1
    print(safe_text(report.format(), multiline=True))
    if mtu is not None:
        print()
        print(safe_text(mtu.format(), multiline=True))
    if links is not None:
        print(f"\nLink bandwidth ({links.caption()}):")
        print(safe_text(links.format(), multiline=True))
    return 0 if ok else 1


def _add_plan_doctor(sub) -> None:
    from ray_mesh.core.layout import FAMILIES
    from ray_mesh.network.report import DEFAULT_TIMEOUT_S

    address_help = "Ray cluster address (else RAY_ADDRESS, else the cluster on this machine)"
    plan = sub.add_parser("plan", help="propose a mesh and rank -> node table for the cluster",
                          description="Without JOB: join the running cluster (never start "
                                      "one) and print the mesh and rank -> node table it "
                                      "would give. With JOB: rank the job's layouts by "
                                      "predicted step time, with no Ray at all; the job's "
                                      "plan.model/plan.step files are imported only with "
                                      "--import-code.")
    plan.add_argument("--address", default=None, type=address_flag, help=address_help)
    plan.add_argument("--layout", choices=FAMILIES, default="hsdp", metavar="FAMILY",
                      help=f"the layout family to propose: {', '.join(FAMILIES)} (default "
                           "hsdp; --tp/--pp size its tp and pp dims)")
    plan.add_argument("--resource", default=None, type=name_flag,
                      help="what one worker takes (default GPU if the cluster has GPUs, else "
                           "CPU; or a custom resource name)")
    plan.add_argument("--tp", type=int_flag(1, example=2), default=None,
                      help="tensor-parallel size")
    plan.add_argument("--pp", type=int_flag(1, example=2), default=None,
                      help="pipeline-parallel size")
    plan.add_argument("job", nargs="?", default=None,
                      help="a job file with a plan: section: rank every layout by predicted "
                           "step time")
    plan.add_argument("--nodes", type=int_flag(1, example=2), default=None,
                      help="with JOB: number of nodes")
    plan.add_argument("--per-node", type=list_flag(int_flag(1, example=4), "per-node"),
                      default=None,
                      help="with JOB: workers per node, or each node's (2,2,1: unequal nodes, "
                           "planned as one replica group per node)")
    plan.add_argument("--node-speed", type=list_flag(positive_number, "node-speed"),
                      default=None, help="with JOB and unequal nodes: each node's speed per "
                      "device, relative to the one plan.compute_s was measured on (1,1,0.5)")
    plan.add_argument("--link-mbit", type=positive_number, default=None,
                      help="with JOB: node link rate in Mbit/s (else plan.link_mbit)")
    plan.add_argument("--json", action="store_true", help="with JOB: machine-readable output")
    plan.add_argument("--calibrate", action="store_true",
                      help="without JOB: time each node's device for ~1 s and show each "
                           "node's speed and share as a replica group")
    plan.add_argument("--import-code", action="store_true",
                      help="with JOB: import the files plan.model / plan.step name (this runs "
                           "their top-level code) to size the model and check the step; "
                           "without it nothing of yours is imported")
    plan.set_defaults(func=_cmd_plan)

    doc = sub.add_parser("doctor", help="check interfaces, versions and connectivity of "
                                        "every live node (bounded)",
                         description="Check every live node's network interfaces, Ray and "
                                     "torch versions, and that the nodes reach each other "
                                     "over the chosen interface. Every wait is bounded.")
    doc.add_argument("--address", default=None, type=address_flag, help=address_help)
    doc.add_argument("--interface", default="auto", type=name_flag,
                     help="'auto' (default) or an interface name to check on every node")
    doc.add_argument("--timeout", type=seconds_flag(), default=DEFAULT_TIMEOUT_S,
                     help=f"bound on the whole check in seconds (default {DEFAULT_TIMEOUT_S:g})")
    doc.add_argument("--port", type=port_flag, default=None,
                     help="also check this fixed rendezvous port (MASTER_PORT) on the head")
    doc.add_argument("--json", action="store_true",
                     help="machine-readable: ok, problems, links [{a, b, mbit_s}], verdict")
    doc.add_argument("--no-links", action="store_true",
                     help="skip the link measurements (path MTU, bandwidth) after the "
                          "pre-flight")
    doc.add_argument("--link-probe", type=seconds_flag(30), default=1.0, metavar="S",
                     help="bound on each link transfer in seconds (default 1)")
    doc.set_defaults(func=_cmd_doctor)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="ray-mesh", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="more output: every rank's network environment line, Ray "
                             "Train's own log lines, debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a YAML job (embedded local Ray without --address)",
                         description=RUN_DESCRIPTION,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("job", help="path to the job's YAML file")
    run.add_argument("--address", default=None, type=address_flag,
                     help="Ray cluster address (else RAY_ADDRESS, else an embedded local Ray)")
    run.add_argument("--num-workers", type=int_flag(1, MAX_WORKERS, example=4), default=None,
                     help="override scaling.num_workers")
    run.add_argument("--storage-path", default=None, metavar="PATH_OR_URI",
                     help="where results and checkpoints go (the job's run.storage_path), "
                          "e.g. s3://bucket/runs")
    run.add_argument("--storage-endpoint", default=None, metavar="URL",
                     help="the S3-compatible server of an s3:// storage path "
                          "(run.storage_endpoint), e.g. http://10.0.0.5:9000; credentials "
                          "come from the AWS environment variables or ~/.aws")
    run.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                     help="more output (as ray-mesh -v)")
    run.set_defaults(func=_cmd_run)
    status = sub.add_parser("status", help="nodes, running ray_mesh runs, layout, metrics",
                            description="Show the cluster's nodes, the ray_mesh runs on it "
                                        "(running, or all with --all), each run's layout "
                                        "and its latest metrics.")
    status.add_argument("--address", default=None, type=status_address_flag,
                        help="GCS address (<head>:6379) or dashboard URL (http://<head>:8265);"
                             " else RAY_ADDRESS, else the local dashboard")
    status.add_argument("--all", action="store_true", help="include finished runs")
    status.add_argument("--json", action="store_true",
                        help="machine-readable: nodes, runs, ranks, per dim the slowest rank, "
                             "links (Mbit/s) and the verdict")
    status.add_argument("--timeout", type=seconds_flag(), default=5.0,
                        help="seconds each answer may take, whole (default 5); a dashboard answer "
                             "or storage file that was late is asked once more with up to 4x "
                             "as long, within --deadline")
    status.add_argument("--deadline", type=seconds_flag(), default=30.0,
                        help="seconds the whole command may take (default 30); what was not "
                             "read by then is named in a note")
    status.add_argument("--max-mb", type=int_flag(1, 4096, example=32), default=32,
                        help="MiB one answer or layout file may hold (default 32)")
    status.add_argument("--storage", action="append", type=storage_flag, metavar="PATH_OR_URI",
                        help="read the layout files of runs whose storage_path is exactly "
                             "this (repeatable). Only storage named here is opened, with this "
                             "machine's credentials; a path the cluster reports is not")
    status.add_argument("--html", default=None, metavar="FILE",
                        help="also draw nodes, ranks, links and curves into a self-contained "
                             "HTML file (rendering into it again extends the curves)")
    status.set_defaults(func=_cmd_status)
    status.add_argument("--storage-endpoint", default=None, metavar="URL",
                        help="the S3 server of the --storage URIs (http://HOST:PORT), as "
                             "the job's run.storage_endpoint")
    _add_plan_doctor(sub)
    from ray_mesh.cli.storage import add_parser as add_storage

    add_storage(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except Exception as exc:
        code = exit_code(exc)  # by class: any ray_mesh.errors.RayMeshError
        if code is None:  # not one of ours: a bug, with its traceback
            raise
        if args.verbose:  # the traceback only on request; the one line either way
            traceback.print_exc()
        # One line; a message may quote what a cluster, a file or a node said: escaped.
        print(f"ray-mesh: error: {safe_text(exc, multiline=True)}", file=sys.stderr)
        return code


def script(argv: list[str] | None = None) -> int:
    """``main`` as the ``ray-mesh`` process runs it: the command, then ``gc.freeze()``.

    The process ends right after: Ray's and logging's exit handlers still run, and every
    object is still released, but the last collections at the interpreter's exit skip the
    millions of objects torch and Ray loaded (~0.9 s of CPU after every command that
    imported them, measured on this 2-core machine: 3.4 s -> 2.5 s for a process that only
    imports torch, Ray Train and DCP). Not for callers that go on (``main`` is theirs)."""
    code = main(argv)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(script())
