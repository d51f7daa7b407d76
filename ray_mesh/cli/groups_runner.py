"""``ray-mesh run`` for a job with a ``replica_groups:`` section: one Ray Train run per group.

The same connection, pre-Ray checks and environment as a one-mesh job
(:mod:`ray_mesh.cli.runner`); then :func:`~ray_mesh.raytrain.replica_groups.fit_replica_groups`
with the section's groups, the job's ``network:`` settings for every group's mesh, its
``scaling.resources_per_worker``/``use_gpu``, and its ``run:`` storage (``storage_path``,
``storage_endpoint``: each group's run and the fallback checkpoints), ``num_to_keep`` (the
fallback checkpoints kept) and ``max_failures`` (each group's restarts, resolved into the
section by :mod:`ray_mesh.cli.job_groups`). The console shows each group's layout at the
start, one line per membership event, and a summary per group at the end (with its
samples/s and tokens/s, and the groups' sum).

A ``data:`` section reaches each group's train function as for one mesh (``config["data"]``),
plus how to read its samples by index (``config["data_index"]``, read with
:func:`ray_mesh.data.group_samples`): the driver's manifest of the files, which each node
checks its own files against, or (``data_from: ray_data``) the rows the driver read once
into Ray's object store.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from ray_mesh.cli.job import Job, JobError
from ray_mesh.cli.preray import check_before_ray
from ray_mesh.cli.runner import ray_session, will_embed
from ray_mesh.errors import GroupsFailed
from ray_mesh.replicas.layouts import GroupLayoutError

EMBEDDED_WORKERS = 4  # groups: auto on an embedded Ray: the workers it is started for
DATA_CPUS = 1  # data_from: ray_data on an embedded Ray: room for Ray Data's read tasks


@dataclass
class GroupsOutcome:
    """A finished run of replica groups."""

    result: Any  # ray_mesh.raytrain.replica_groups.ReplicaGroupsResult
    wall_s: float
    tokens_per_sample: int | None = None  # data.seq_len with a data: section


def _use_gpu(job: Job, cluster: dict[str, float], workers: int | None) -> bool:
    use_gpu = job.scaling.use_gpu
    if use_gpu == "auto":
        return cluster.get("GPU", 0) >= (workers or 1)
    return bool(use_gpu)


def group_config(job: Job, verbose: bool = False) -> dict[str, Any]:
    """The groups' train function config: the job's, with its ``data:`` section and how
    to read it by index (see the module docstring). Reads through Ray Data when the
    section says ``data_from: ray_data`` (inside the Ray session; Ray Data's own log lines
    on this console only with ``verbose``: one ray-mesh line says what was read)."""
    if job.data is None:
        return job.config
    from ray_mesh.data.indexed import INDEX_KEY, manifest

    if job.replica_groups.data_from == "ray_data":
        from ray_mesh.data.indexed_ray import ray_samples

        node = ray.get_runtime_context().get_node_id()
        cpus = next((n.get("Resources", {}).get("CPU", 0) for n in ray.nodes()
                     if n.get("NodeID") == node), 0)
        if cpus < 1:
            raise JobError("replica_groups.data_from: ray_data reads the data on the driver's "
                           "node, which has no CPU for Ray Data's tasks. Run the driver on a "
                           "node with a CPU, or use data_from: files.")
        importlib.import_module("ray.data")  # it sets its loggers' levels on import: first
        t0 = time.monotonic()
        quiet = logging.getLogger("ray.data")
        level = quiet.level
        if not verbose:  # its execution plan and a warning that progress bars are off
            quiet.setLevel(logging.ERROR)
        try:
            index = {"samples": ray_samples(job.data)}
        finally:
            quiet.setLevel(level)
        print(f"ray-mesh: data: {len(index['samples'])} training rows read into the object "
              f"store in {time.monotonic() - t0:.1f} s (data_from: ray_data)", flush=True)
    else:
        index = {"manifest": manifest(job.data)}
    return {**job.config, "data": job.data.to_dict(), INDEX_KEY: index}


def run_groups_outcome(job: Job, address: str | None = None,
                       verbose: bool = False) -> GroupsOutcome:
    """Check the job, connect to Ray and run its replica groups to the end."""
    from ray_mesh.raytrain.backend import MeshConfig
    from ray_mesh.raytrain.replica_groups import describe, fit_replica_groups

    section = job.replica_groups
    train_fn = job.load_train_fn()  # fails before Ray starts
    per_worker = dict(job.scaling.resources_per_worker or {})
    workers = section.workers()
    cpus = (workers or EMBEDDED_WORKERS) * float(per_worker.get("CPU", 1))
    cpus += DATA_CPUS if job.data is not None and section.data_from == "ray_data" else 0
    check_before_ray(job, will_embed(address), workers=workers or EMBEDDED_WORKERS)
    with ray_session(address, cpus):
        config = group_config(job, verbose)
        use_gpu = _use_gpu(job, ray.cluster_resources(), workers)
        mesh = MeshConfig(mesh={"dp_shard": -1}, verbose=verbose,
                          total_steps=section.steps, **job.network.mesh_config_kwargs())
        t0 = time.monotonic()
        try:
            result = fit_replica_groups(
                train_fn, **section.fit_kwargs(), mesh_config=mesh, config=config,
                name=job.name, storage_path=job.run.storage_path,
                storage_endpoint=job.run.storage_endpoint, num_to_keep=job.run.num_to_keep,
                resources_per_worker=per_worker or None, use_gpu=use_gpu,
                on_event=lambda e: print(f"ray-mesh: {describe(e)}", flush=True),
                on_groups=lambda line: print(f"ray-mesh: {line}", flush=True))
        except (GroupLayoutError, GroupsFailed) as exc:
            raise JobError(str(exc)) from None
        return GroupsOutcome(result, time.monotonic() - t0,
                             job.data.seq_len if job.data is not None else None)


RATE_KEYS = ("steps_per_s", "samples_per_s", "tokens_per_s", "samples", "tokens")
"""A group's report keys shown as rates (or left out: counts since its attempt began)."""


def _group_rates(metrics: dict[str, Any], share: dict[str, Any],
                 tokens_per_sample: int | None) -> dict[str, float]:
    """A group's samples/s and tokens/s: from its reports (``samples``/``tokens`` counts,
    between its first and last report), else its compute rate as the quorum measured it
    (times the tokens a sample holds, with a ``data:`` section)."""
    samples = metrics.get("samples_per_s") or share.get("samples_per_s")
    tokens = metrics.get("tokens_per_s") or (samples * tokens_per_sample
                                             if samples and tokens_per_sample else None)
    return {unit: float(v) for unit, v in (("samples/s", samples), ("tokens/s", tokens)) if v}


def groups_summary(name: str, storage: str | None, outcome: GroupsOutcome
                   ) -> tuple[list[str], bool]:
    """The final summary of a run of replica groups, and whether every group finished."""
    res = outcome.result
    status = res.status
    layouts = status.get("layouts", {})
    shares = status.get("shares", {})
    lines = [f"ray-mesh: run {name!r} finished: {status.get('step', 0)} steps of "
             f"{len(res.groups)} replica group(s) in {outcome.wall_s:.1f} s (start-up "
             f"included)"]
    ok = True
    totals = {"samples/s": 0.0, "tokens/s": 0.0}
    for gid, got in sorted(res.groups.items()):
        metrics = {k: v for k, v in (got.get("metrics") or {}).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)
                   and not k.startswith("replica_groups/")}
        rates = _group_rates(metrics, shares.get(gid, {}), outcome.tokens_per_sample)
        head = f"  group {gid} ({layouts.get(gid, '?')}): " + "".join(
            f"{v:.4g} {unit}, " for unit, v in rates.items())
        if got.get("error"):
            ok = False
            lines.append(head + f"ended with {str(got['error'])[:300]}")
            continue
        for unit, v in rates.items():
            totals[unit] += v
        shown = {k: v for k, v in metrics.items() if k not in RATE_KEYS}
        lines.append(head + (", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in shown.items()) or "no report"))
    if any(totals.values()):
        lines.append("  throughput:  " + ", ".join(
            f"{v:.4g} {unit}" for unit, v in totals.items() if v) + " (the groups' rates "
            f"summed, training steps only); {status.get('consumed', 0)} samples used")
    events = res.events
    left = sum(e["kind"] == "left" for e in events)
    lines.append(f"  events:      {len(events)} ({left} left, "
                 f"{sum(e['kind'] == 'healed' for e in events)} healed); "
                 + (f"`ray-mesh status --storage {storage}` shows them" if storage
                    else "set run.storage_path to keep them for `ray-mesh status`"))
    return lines, ok


__all__ = ["GroupsOutcome", "group_config", "groups_summary", "run_groups_outcome"]
