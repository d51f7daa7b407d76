"""Elastic runs: a worker count that follows the nodes, with the mesh shrinking in dp_replicate.

What Ray Train (V2) offers, read in ``ray/train/v2``:

* ``ScalingConfig(num_workers=(min_workers, max_workers))`` turns on
  ``ElasticScalingPolicy``. On every (re)start it counts the workers that fit on the
  resources it reserved (per node: ``floor(node resources / resources_per_worker)``, capped
  at ``max_workers``) and starts that many if it is ``>= min_workers``, else waits. While the
  group runs, every ``elastic_resize_monitor_interval_s`` (default 60 s) it recounts and
  restarts the group at the new size when it changed: a node that comes back makes the run
  grow at that restart.
* A lost node is a worker-group failure: it is charged to ``FailureConfig(max_failures)``
  and the group restarts (smaller, when elastic). Training state is not carried over: the
  train function restarts and must resume from a checkpoint (``Checkpointer.restore``).
* A fixed-size run that lost a node waits for the placement group, times out after
  ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (60 s) and retries; those are controller
  failures, retried forever by default (``FailureConfig(controller_failure_limit=-1)``).
  :func:`failure_config` bounds them, and :func:`explain_startup_failure` turns the
  resulting error into one that says what happened and what to change
  (upstream: ray-train-start-waits-forever).

The mesh side needs nothing new at restart: ``MeshSpec.hsdp()`` has ``dp_replicate='nodes'``
and ``dp_shard=-1``, which the backend resolves against the topology of each new worker
group; ``Checkpointer.restore`` reshards the last checkpoint onto it (DCP). What this module
adds is the check, on the driver, that a mesh can shrink that way.
"""

from __future__ import annotations

import math

from ray_mesh.core.spec import NODES, MeshSpec, MeshSpecError

STARTUP_RETRIES = 3
"""How many times a worker group that cannot start is retried before the run fails (job files:
``run.startup_retries``). Ray's own default is forever (``controller_failure_limit=-1``)."""


def check_elastic_mesh(spec: MeshSpec, min_workers: int, max_workers: int) -> None:
    """Raise unless only ``dp_replicate`` changes between ``min_workers`` and ``max_workers``.

    tp, cp, pp and the shard group size must stay what they are: a different tp or dp_shard
    would change every layer's layout and every node's memory per rank. Growing and
    shrinking whole replicas (nodes) keeps them.
    """
    if not 1 <= min_workers <= max_workers:
        raise MeshSpecError(f"An elastic worker range needs 1 <= min_workers <= max_workers, "
                            f"got ({min_workers}, {max_workers}).")
    if spec.dp_replicate not in (NODES, -1):
        raise MeshSpecError(
            f"An elastic run ({min_workers}..{max_workers} workers) needs dp_replicate to "
            f"follow the cluster: use dp_replicate='nodes' (MeshSpec.hsdp(), mesh: hsdp) or "
            f"-1, not dp_replicate={spec.dp_replicate}. Or give a fixed num_workers."
        )
    fixed = {n: getattr(spec, n) for n in ("pp", "dp_shard", "cp", "tp")}
    open_dims = [n for n, v in fixed.items() if v == -1]
    if spec.dp_replicate == -1 and open_dims:  # MeshSpec allows one -1 only; belt and braces
        raise MeshSpecError(f"With dp_replicate=-1, {open_dims} must be sizes for elasticity.")
    if spec.dp_replicate == -1:
        # Every worker count in the range must be a whole number of replicas at both ends.
        group = math.prod(fixed.values())
        bad = [w for w in (min_workers, max_workers) if w % group]
        if bad:
            raise MeshSpecError(
                f"Elastic range ({min_workers}, {max_workers}): {bad} workers is not a multiple "
                f"of pp*dp_shard*cp*tp = {group}, so dp_replicate cannot absorb the change. "
                f"Use multiples of {group}."
            )


def failure_config(max_failures: int, startup_retries: int = STARTUP_RETRIES):
    """``FailureConfig`` whose worker-group start-up retries are bounded.

    Ray retries a group that cannot start (e.g. a fixed-size run after losing a node)
    forever by default; with ``startup_retries`` it gives up after that many timeouts and
    :func:`explain_startup_failure` can say why.
    """
    from ray.train import FailureConfig

    return FailureConfig(max_failures=max_failures, controller_failure_limit=startup_retries)


def explain_startup_failure(error: BaseException, num_workers: int | tuple[int, int]) -> str | None:
    """A message for "the worker group could not start again", or None for other errors."""
    text = f"{type(error).__name__}: {error}"
    cause = getattr(error, "controller_failure", None) or error.__cause__
    if cause is not None:
        text += f" {type(cause).__name__}: {cause}"
    if "WorkerGroupStartupTimeoutError" not in text and "startup timed out" not in text.lower():
        return None
    if isinstance(num_workers, tuple):
        return (
            f"The worker group could not start again: fewer than min_workers={num_workers[0]} "
            f"workers fit on the cluster now (a node lost?). Bring nodes back, or lower the "
            f"minimum. ({text})"
        )
    return (
        f"The worker group could not start again with its fixed {num_workers} workers: the "
        f"cluster no longer has room for them (a node lost?). This run is not elastic. Bring "
        f"the node back and resume (same name and storage_path), or allow the run to shrink: "
        f"ScalingConfig(num_workers=(min, max)) with a mesh whose dp_replicate follows the "
        f"nodes (MeshSpec.hsdp()); in a job file, run.min_workers. ({text})"
    )
