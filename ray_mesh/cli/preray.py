"""What the driver can check about a job before Ray starts, and the user error inside Ray's.

``ray-mesh run`` calls :func:`check_before_ray` before ``ray.init``: a storage path this
machine cannot write, more workers than an embedded Ray on this machine can hold, or an
interface (``network.interface``, or a ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` the
user set) that does not exist here fail in a second instead of after Ray's start-up. On a
cluster the same interface checks run on every node during bring-up (``ray_mesh.raytrain``).

:func:`user_error_inside` finds our own error (a ``PreflightError``, say) inside the
``ControllerError``/``WorkerGroupError`` that Ray Train wraps it in, so the console shows
its message as one line, not Ray's wrapper and traceback; :func:`train_function_failure`
says in one line which ranks' train function raised what, when the error is the user's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from ray_mesh.cli.job import Job, JobError
from ray_mesh.core.safe import clip
from ray_mesh.network.interfaces import (
    NetworkError,
    choose_interface,
    local_interfaces,
    user_ifname_problems,
)

WORKER_MEMORY_GB = 0.5
"""What one Ray Train worker process holding torch takes at least (resident, CPU)."""


def embedded_capacity_problem(num_workers: int, total_bytes: int) -> str | None:
    """Why ``num_workers`` workers cannot run on an embedded Ray of this machine, or None."""
    fit = int(total_bytes / (WORKER_MEMORY_GB * 2**30))
    if num_workers <= max(fit, 1):
        return None
    return (f"scaling.num_workers: {num_workers} workers on this machine's embedded Ray need "
            f"about {num_workers * WORKER_MEMORY_GB:.0f} GB of memory (each worker is a process "
            f"holding torch, ~{WORKER_MEMORY_GB} GB), but it has {total_bytes / 2**30:.0f} GB: "
            f"lower scaling.num_workers (or --num-workers) to at most {fit}, or run on a "
            f"cluster with --address <head>:6379.")


def check_before_ray(job: Job, embedded: bool, workers: int | None = None) -> str:
    """Driver-side checks that need no Ray; raise JobError/StorageError/NetworkError.
    ``workers``: the run's worker count when it is not ``scaling.num_workers`` (replica
    groups). Returns the checked storage path (the nodes probe it once Ray is up)."""
    from ray_mesh.raytrain.launch import probe_storage

    # A local path, or a bucket (endpoint, bucket, credentials, a write probe): each failure
    # is one line here, before Ray or any worker starts. The driver's only probe of it.
    storage_path = probe_storage(job)
    if not embedded:
        return storage_path
    import psutil

    why = embedded_capacity_problem(workers or job.scaling.num_workers,
                                    psutil.virtual_memory().total)
    if why:
        raise JobError(why)
    # The embedded Ray's only node is this machine, and its workers inherit this environment.
    table = local_interfaces()
    iface = job.network.options.interface
    if iface != "auto":
        try:
            choose_interface("this machine", iface, table)
        except NetworkError as exc:
            raise JobError(f"network.interface: {exc}") from None
    nccl = job.network.backend is not None and "nccl" in job.network.backend
    problems = user_ifname_problems(dict(os.environ), table, nccl=nccl)
    if problems:
        raise NetworkError(f"On this machine (the embedded Ray's node): {problems[0]}")
    return storage_path


def _inner(exc: BaseException) -> Iterator[BaseException]:
    cause = getattr(exc, "cause", None)  # a RayTaskError's original exception
    if isinstance(cause, BaseException):
        yield cause
    failure = getattr(exc, "controller_failure", None)  # Ray Train V2's ControllerError
    if isinstance(failure, BaseException):
        yield failure
    failures = getattr(exc, "worker_failures", None)  # V2's WorkerGroupError
    if isinstance(failures, dict):
        yield from (f for f in failures.values() if isinstance(f, BaseException))
    for linked in (exc.__cause__, exc.__context__):
        if linked is not None:
            yield linked


def user_error_inside(exc: BaseException, types: tuple[type[BaseException], ...]
                      ) -> BaseException | None:
    """The first error of ``types`` wrapped in ``exc`` (Ray's wrappers unwrapped), or None."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        original = getattr(current, "cause", None)
        if isinstance(current, types) and not isinstance(original, BaseException):
            return current
        todo.extend(_inner(current))
    return None


def train_function_failure(exc: BaseException) -> str | None:
    """``rank(s) 0, 1: ValueError: bad batch`` for a ``WorkerGroupError`` (the train
    function raised on those ranks; each rank's traceback is on the console already), or
    None for any other error. Ranks that raised the same are named together."""
    failures = getattr(exc, "worker_failures", None)
    if not isinstance(failures, dict) or not failures:
        return None
    by_text: dict[str, list[int]] = {}
    for rank, error in sorted(failures.items(), key=lambda kv: str(kv[0])):
        by_text.setdefault(_last_line(error), []).append(rank)
    # The cause first: when one rank raises, ranks in a collective with it fail on the
    # process group as Ray Train tears the group down (seen: "Could not resolve the process
    # group registered under the name 0" on a rank still in fully_shard).
    ordered = sorted(by_text.items(), key=lambda kv: _secondary(kv[0]))
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}"
                     for text, r in ordered)


SECONDARY = ("DistBackendError", "DistNetworkError", "DistStoreError", "process group",
             "Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What a rank's error says when it failed because another rank did (torch.distributed's
errors of a peer gone, in the words gloo and the store use)."""


def _secondary(text: str) -> bool:
    return any(s in text for s in SECONDARY)


def _last_line(error: BaseException) -> str:
    """``Type: message``, from the last line of what a worker's error says (a wrapped
    error's text ends with the original's ``Type: message`` line), at most 300 characters."""
    lines = [x for x in str(error).strip().splitlines() if x.strip()]
    last = lines[-1].strip() if lines else ""
    name = type(error).__name__
    head = last.split(":", 1)[0]
    text = last if head.isidentifier() and head.endswith(("Error", "Exception")) \
        else f"{name}: {last}" if last else name
    return clip(text, 300)
