"""``ray-mesh run`` for a job with a ``replica_groups:`` section: one Ray Train run per group.

The same connection, pre-Ray checks and environment as a one-mesh job
(:mod:`ray_mesh.cli.runner`); then :func:`~ray_mesh.raytrain.replica_groups.fit_replica_groups`
with the section's groups, the job's ``network:`` settings for every group's mesh, its
``scaling.resources_per_worker``/``use_gpu``, and its ``run:`` storage (``storage_path``,
``storage_endpoint``: each group's run and the fallback checkpoints), ``num_to_keep`` (the
fallback checkpoints kept) and ``max_failures`` (each group's restarts, resolved into the
section by :mod:`ray_mesh.cli.job_groups`). The console shows each group's layout at the
start, one line per membership event, and a summary per group at the end.
"""

from __future__ import annotations

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


@dataclass
class GroupsOutcome:
    """A finished run of replica groups."""

    result: Any  # ray_mesh.raytrain.replica_groups.ReplicaGroupsResult
    wall_s: float


def _use_gpu(job: Job, cluster: dict[str, float], workers: int | None) -> bool:
    use_gpu = job.scaling.use_gpu
    if use_gpu == "auto":
        return cluster.get("GPU", 0) >= (workers or 1)
    return bool(use_gpu)


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
    check_before_ray(job, will_embed(address), workers=workers or EMBEDDED_WORKERS)
    with ray_session(address, cpus):
        use_gpu = _use_gpu(job, ray.cluster_resources(), workers)
        mesh = MeshConfig(mesh={"dp_shard": -1}, verbose=verbose,
                          total_steps=section.steps, **job.network.mesh_config_kwargs())
        t0 = time.monotonic()
        try:
            result = fit_replica_groups(
                train_fn, **section.fit_kwargs(), mesh_config=mesh, config=job.config,
                name=job.name, storage_path=job.run.storage_path,
                storage_endpoint=job.run.storage_endpoint, num_to_keep=job.run.num_to_keep,
                resources_per_worker=per_worker or None, use_gpu=use_gpu,
                on_event=lambda e: print(f"ray-mesh: {describe(e)}", flush=True),
                on_groups=lambda line: print(f"ray-mesh: {line}", flush=True))
        except (GroupLayoutError, GroupsFailed) as exc:
            raise JobError(str(exc)) from None
        return GroupsOutcome(result, time.monotonic() - t0)


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
    for gid, got in sorted(res.groups.items()):
        share = shares.get(gid, {})
        speed = share.get("samples_per_s")
        head = (f"  group {gid} ({layouts.get(gid, '?')}): "
                + (f"{speed:.3g} samples/s, " if speed else ""))
        if got.get("error"):
            ok = False
            lines.append(head + f"ended with {str(got['error'])[:300]}")
            continue
        metrics = {k: v for k, v in (got.get("metrics") or {}).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)
                   and not k.startswith("replica_groups/")}
        lines.append(head + (", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in metrics.items()) or "no report"))
    events = res.events
    left = sum(e["kind"] == "left" for e in events)
    lines.append(f"  events:      {len(events)} ({left} left, "
                 f"{sum(e['kind'] == 'healed' for e in events)} healed); "
                 + (f"`ray-mesh status --storage {storage}` shows them" if storage
                    else "set run.storage_path to keep them for `ray-mesh status`"))
    return lines, ok


__all__ = ["GroupsOutcome", "groups_summary", "run_groups_outcome"]
