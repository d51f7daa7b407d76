"""``ray-mesh run`` for a job with a ``replica_groups:`` section: one Ray Train run per group.

The same connection, pre-Ray checks and environment as a one-mesh job
(:mod:`ray_mesh.cli.runner`), and the same launch layer (:mod:`ray_mesh.raytrain.launch`)
putting the run together: the section's groups, the job's ``network:`` settings for every
group's mesh, its ``scaling.resources_per_worker``/``use_gpu``, and its ``run:`` storage
(``storage_path``, ``storage_endpoint``: each group's run and the fallback checkpoints),
``num_to_keep`` (the fallback checkpoints kept) and ``max_failures`` (each group's
restarts, resolved into the section by :mod:`ray_mesh.cli.job_groups`), handed to
:func:`~ray_mesh.raytrain.replica_groups.fit_replica_groups`. The console shows each
group's layout at the start, one line per membership event, and a summary per group at
the end (with its samples/s and tokens/s, and the groups' sum).

A ``data:`` section reaches each group's train function as for one mesh (``config["data"]``),
plus how to read its samples by index (``config["data_index"]``, read with
:func:`ray_mesh.data.group_samples`): the driver's manifest of the files, which each node
checks its own files against, or (``data_from: ray_data``) the rows the driver read once
into Ray's object store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ray_mesh.cli.console_tail import final_steps, progress_tail
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


def _say(line: str) -> None:
    print(f"ray-mesh: {line}", flush=True)


def group_config(job: Job, verbose: bool = False) -> dict[str, Any]:
    """The groups' train function config (:func:`ray_mesh.raytrain.launch.groups_config`),
    its line on what was read printed here."""
    from ray_mesh.raytrain.launch import groups_config

    return groups_config(job, verbose, say=_say)


def run_groups_outcome(job: Job, address: str | None = None,
                       verbose: bool = False) -> GroupsOutcome:
    """Check the job, connect to Ray and run its replica groups to the end."""
    from ray_mesh.raytrain.launch import run_parts
    from ray_mesh.raytrain.replica_groups import describe, fit_replica_groups

    section = job.replica_groups
    train_fn = job.load_train_fn()  # fails before Ray starts
    per_worker = dict(job.scaling.resources_per_worker or {})
    workers = section.workers()
    cpus = (workers or EMBEDDED_WORKERS) * float(per_worker.get("CPU", 1))
    cpus += DATA_CPUS if job.data is not None and section.data_from == "ray_data" else 0
    # The storage (the driver's one probe), size, interfaces: before Ray starts.
    storage_path = check_before_ray(job, will_embed(address),
                                    workers=workers or EMBEDDED_WORKERS)
    with ray_session(address, cpus), progress_tail() as tail:
        parts = run_parts(job, storage_path, train_fn=train_fn, verbose=verbose, say=_say)
        t0 = time.monotonic()
        try:
            result = fit_replica_groups(
                parts.train_fn, **parts.groups_kwargs(),
                on_event=lambda e: _say(describe(e)), on_groups=_say)
        except (GroupLayoutError, GroupsFailed) as exc:
            raise JobError(str(exc)) from None
        wall_s = time.monotonic() - t0
        # Each group's last progress line printed before the summary (console_tail).
        tail.wait(final_steps({f"{job.name}-g{gid}": got.get("metrics") or {}
                               for gid, got in result.groups.items()
                               if not got.get("error") and got.get("fresh", True)},
                              section.steps), say=_say)
        return GroupsOutcome(result, wall_s, job.data.seq_len if job.data is not None else None)


RATE_KEYS = ("steps_per_s", "samples_per_s", "tokens_per_s", "samples", "tokens")
"""A group's report keys shown as rates (or left out: counts since its attempt began)."""


def _group_rates(metrics: dict[str, Any], share: dict[str, Any],
                 tokens_per_sample: int | None) -> tuple[dict[str, float], str]:
    """A group's samples/s and tokens/s, and what they are (``RATE_KINDS``):

    * ``run``: what it did, from its reports' counts (``samples``/``tokens``, between its
      first and last report);
    * ``window``: what it did in its last report's window only, by its loop's own clock
      (``tokens_per_s`` without counts over two reports: a group that rejoined late and
      reported once); samples/s then follow from its tokens/s, so both say the same thing;
    * ``pace``: how fast it would go alone, as the quorum measured it for ``shares`` (its
      compute and its own boundary work, waits for the other groups excluded: not what it
      did in the run; a 1-rank group of a small model shows 1e4 samples/s where the run
      made 100).
    """
    samples, tokens = metrics.get("samples_per_s"), metrics.get("tokens_per_s")
    kind = "run" if samples else "window" if tokens else "pace"
    if kind == "window" and tokens_per_sample:
        samples = tokens / tokens_per_sample
    elif kind == "pace":
        samples = share.get("samples_per_s")
        tokens = samples * tokens_per_sample if samples and tokens_per_sample else None
    elif not tokens and tokens_per_sample:
        tokens = samples * tokens_per_sample
    rates = {unit: float(v) for unit, v in (("samples/s", samples), ("tokens/s", tokens)) if v}
    return rates, kind


# How a group's rates are said on its summary line (before them, after them)
RATE_KINDS = {"run": ("", ""), "pace": ("pace ", ""),
              "window": ("", "in its last report's window only (one report: not in the "
                             "throughput below), ")}


def groups_summary(name: str, storage: str | None, outcome: GroupsOutcome
                   ) -> tuple[list[str], bool]:
    """The final summary of a run of replica groups, and whether it succeeded: no group
    ended with an error (a group whose node had not come back by the end is said, not a
    failure: the others took every step)."""
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
        rates, kind = _group_rates(metrics, shares.get(gid, {}), outcome.tokens_per_sample)
        before, after = RATE_KINDS[kind] if rates else ("", "")
        head = f"  group {gid} ({layouts.get(gid, '?')}): " + before + "".join(
            f"{v:.4g} {unit}, " for unit, v in rates.items()) + after
        did = kind == "run"
        if got.get("error"):
            ok = False
            lines.append(head + f"ended with {str(got['error'])[:300]}")
            continue
        if got.get("absent"):  # the others took every step: not a failed run
            lines.append(head + f"not there at the end: {str(got['absent'])[:300]}; the "
                         f"other groups took its samples")
            continue
        for unit, v in rates.items():
            totals[unit] += v if did else 0.0
        shown = {k: v for k, v in metrics.items() if k not in RATE_KEYS}
        lines.append(head + (", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in shown.items()) or "no report"))
    used = status.get("consumed", 0)
    if any(totals.values()):
        lines.append("  throughput:  " + ", ".join(
            f"{v:.4g} {unit}" for unit, v in totals.items() if v) + " (the reporting groups' "
            f"rates summed, each from its first report to its last); {used} samples used")
    elif used and outcome.wall_s > 0:
        lines.append(f"  throughput:  {used} samples used in {outcome.wall_s:.1f} s, "
                     f"{used / outcome.wall_s:.4g} samples/s (start-up included; a 'pace' "
                     f"above is a group's own speed, waits for the others excluded)")
    events = res.events
    left = sum(e["kind"] == "left" for e in events)
    lines.append(f"  events:      {len(events)} ({left} left, "
                 f"{sum(e['kind'] == 'healed' for e in events)} healed); "
                 + (f"`ray-mesh status --storage {storage}` shows them" if storage
                    else "set run.storage_path to keep them for `ray-mesh status`"))
    return lines, ok
