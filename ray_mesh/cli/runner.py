"""Run a :class:`~ray_mesh.cli.job.Job` on Ray: embedded local Ray, or a cluster by address.

The engine of ``ray-mesh run``: it connects (an embedded Ray or a cluster's), has the launch
layer (:mod:`ray_mesh.raytrain.launch`) check the job against the cluster and put its run
together, and shows our own error out of Ray's wrappers. It speaks the job file's and the
command line's terms (``--address``, ``scaling.num_workers``), so it lives with them in
``cli``, above the Ray glue it drives (``ray_mesh.raytrain``).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from ray.train import Result

import ray_mesh.private_apis as private_apis
from ray_mesh.cli.console_tail import final_steps, progress_tail
from ray_mesh.cli.flags import address_problem
from ray_mesh.cli.job import Job, JobError
from ray_mesh.cli.preray import check_before_ray, train_function_failure, user_error_inside
from ray_mesh.core.priority import RAY_NICENESS_ENV
from ray_mesh.errors import ConfigurationError, TrainFunctionError, UserInputError
from ray_mesh.network.interfaces import NetworkError, host_port, split_host_port
from ray_mesh.observability.report import last_report
from ray_mesh.raytrain.auth import secure_token_file
from ray_mesh.raytrain.backend import BringUpError
from ray_mesh.raytrain.driver import CLI_ENV
from ray_mesh.raytrain.elastic import explain_startup_failure
from ray_mesh.raytrain.launch import check_data_resources as check_data_resources
from ray_mesh.raytrain.launch import check_resources as check_resources
from ray_mesh.raytrain.launch import mesh_config as mesh_config
from ray_mesh.raytrain.launch import run_parts
from ray_mesh.raytrain.launch import scaling_for as scaling_for

logger = logging.getLogger(__name__)

DATA_CPUS = 2
"""CPUs an embedded Ray adds for Ray Data's read and pack tasks when the job has ``data:``."""
USER_ERROR_TYPES = (UserInputError, ConfigurationError, NetworkError, BringUpError)
"""Our errors that Ray Train wraps (ControllerError, WorkerGroupError): shown unwrapped."""


def connect(address: str | None, num_cpus_needed: float) -> bool:
    """Join ``address`` (or RAY_ADDRESS); with neither, start an embedded local Ray.

    Returns True when this call started Ray (the caller shuts it down).
    """
    if ray.is_initialized():
        return False
    given = "--address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS")
    why = address_problem(address) if address else None
    if why:
        raise JobError(f"{given}: {why}.")
    if address:
        secure_token_file(create=False)  # a token others can read: tightened, with a warning
        check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=True, runtime_env={
                "worker_process_setup_hook": "ray_mesh.raytrain.driver.cluster_worker_setup"})
        except Exception as exc:  # ConnectionError, TimeoutError, ...
            auth = ""
            if "auth" in f"{type(exc).__name__} {exc} {exc.__cause__}".lower():
                auth = (" The cluster uses token authentication: copy the head's "
                        "~/.ray/auth_token to this machine and set RAY_AUTH_MODE=token.")
            raise JobError(
                f"Cannot reach the Ray cluster at {address!r}: {type(exc).__name__}: {exc}.{auth}"
                f" Check `ray status` on the head node, the address and port (default 6379), "
                f"and that this machine can reach it (Tailscale up?). Leave --address and "
                f"RAY_ADDRESS unset to run on an embedded local Ray."
            ) from exc
        return False
    # CPU workers on a small machine: let Ray count enough CPUs for all of them.
    # address='local': a new instance even when `ray start` left one running on this host.
    # Its workers run this job only: start them at niceness 0 like torchrun's ranks (Ray's
    # default is 15; see ray_mesh.core.priority). They inherit it from raylet, which inherits
    # this process's environment; an unprivileged worker could not lower it later.
    # A new local Ray writes ~/.ray/auth_token with the umask (0644): create it first, 0600
    # (upstream: ray-auth-token-umask).
    secure_token_file(create=True)
    began = time.monotonic()
    # Ray's WARNING that its default, token authentication, is on: ray_mesh keeps it on by
    # design (docs/security.md), so the line only alarms (upstream: ray-auth-default-warning).
    with env_defaults({RAY_NICENESS_ENV: "0"}), private_apis.quiet_default_auth_notice():
        try:
            ray.init(address="local",
                     num_cpus=max(os.cpu_count() or 1, math.ceil(num_cpus_needed)),
                     runtime_env={"worker_process_setup_hook":
                                  "ray_mesh.raytrain.driver.embedded_worker_setup"})
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for this
            raise BringUpError(_embedded_start_failed(exc, time.monotonic() - began)) from exc
    secure_token_file(create=False)
    # This driver's own state-API calls go to this instance too
    # (upstream: ray-state-api-multiple-instances).
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    return True


def _embedded_start_failed(exc: BaseException, waited_s: float) -> str:
    """The one line for an embedded Ray that did not start: what Ray said and the way on.
    Seen: "The current node timed out during startup" after 6 minutes on a 2-core machine
    running a test suite and two CPU hogs, as a traceback."""
    said = " ".join(str(exc).split())[:300]
    line = (f"the embedded local Ray did not start after {waited_s:.0f} s "
            f"({type(exc).__name__}: {said}).")
    if "timed out" in said.lower():
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        return (f"{line} This machine's load average is {load:.1f} on {os.cpu_count() or 1} "
                f"cores: run again when it is less busy, or start Ray once yourself (ray "
                f"start --head) and pass --address 127.0.0.1:6379")
    return (f"{line} Fix what Ray names (its temp dir is RAY_TMPDIR or /tmp/ray), or start "
            f"Ray yourself (ray start --head) and pass --address 127.0.0.1:6379")


@contextmanager
def env_defaults(values: dict[str, str]) -> Iterator[None]:
    """Set each variable the user did not set, for the duration of the block."""
    added = [k for k in values if k not in os.environ]
    os.environ.update({k: values[k] for k in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextmanager
def ray_session(address: str | None, num_cpus_needed: float) -> Iterator[bool]:
    """Ray for one job: the CLI's environment defaults, :func:`connect`, and on the way
    out an embedded Ray shut down and the RAY_ADDRESS it set removed. Yields whether this
    job started Ray."""
    saved_address = os.environ.get("RAY_ADDRESS")  # connect() sets it for an embedded Ray
    with env_defaults(CLI_ENV):
        started = connect(address, num_cpus_needed)
        try:
            yield started
        finally:
            if started:
                ray.shutdown()
                if saved_address is None:
                    os.environ.pop("RAY_ADDRESS", None)


def will_embed(address: str | None) -> bool:
    """Whether a job run now starts its own local Ray (no address, no RAY_ADDRESS, no Ray)."""
    return not (address or os.environ.get("RAY_ADDRESS")) and not ray.is_initialized()


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail within ``timeout_s`` unless a Ray GCS answers at ``address``.

    ``ray.init`` on an address that does not answer can block for minutes. A bare TCP
    connect is not proof either (proxies and port forwards accept anything), so this makes
    one gRPC call to the GCS: an answer, even "unauthenticated", means Ray is there.
    """
    if address in ("auto", "local") or os.environ.get("RAY_USE_TLS", "0") not in ("0", ""):
        return
    import grpc  # a Ray dependency

    target, default_port, gcs = address, 6379, True
    if target.startswith("ray://"):
        target, default_port, gcs = target[len("ray://"):], 10001, False
    try:
        host, port = split_host_port(target.rstrip("/"), default_port)
    except ValueError as exc:
        raise JobError(f"--address {address!r} is not an address: {exc}") from exc
    where = host_port(host, port)
    ok = {grpc.StatusCode.OK, grpc.StatusCode.UNAUTHENTICATED}
    if not gcs:  # Ray Client's server: any gRPC answer will do
        ok |= {grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT,
               grpc.StatusCode.INTERNAL}
    with grpc.insecure_channel(where) as channel:
        try:
            private_apis.gcs_ping(channel, timeout_s)
            return
        except grpc.RpcError as exc:
            code, details = exc.code(), (exc.details() or "")[:200]
    if code == grpc.StatusCode.UNAUTHENTICATED and gcs and not _sends_token():
        # ray.init would retry for ~20 s, a line a second, before failing with this cause.
        raise JobError(
            f"The Ray cluster at {address!r} uses token authentication and this shell does "
            f"not send a token (RAY_AUTH_MODE is not 'token'). Copy the head's "
            f"~/.ray/auth_token to this machine (or set RAY_AUTH_TOKEN) and set "
            f"RAY_AUTH_MODE=token.")
    if code in ok:
        return
    why = (f"no answer within {timeout_s:g} s" if code == grpc.StatusCode.DEADLINE_EXCEEDED
           else f"{code.name}: {details}")
    not_ray = (" Something answers there, but it is not a Ray GCS." if code in (
        grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL) else "")
    raise JobError(
        f"Cannot reach the Ray cluster at {address!r}: {where} gave {why}.{not_ray} Is Ray "
        f"running there (`ray status` on the head)? Use the head's tailnet address "
        f"(`tailscale ip -4` on the head) and its GCS port (default 6379), and check this "
        f"machine reaches it (`tailscale ping {host}`)."
    )


def _sends_token() -> bool:
    """Whether Ray's client in this process sends the auth token: only when
    ``RAY_AUTH_MODE=token``, whatever token file it could read
    (upstream: ray-client-token-needs-auth-mode)."""
    return os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token"


@dataclass
class RunOutcome:
    """A finished run and what the console summary says about it."""

    result: Result
    wall_s: float
    metrics_url: str | None  # the Prometheus endpoint of the driver's node
    embedded: bool  # the endpoint went away with the embedded Ray
    metrics: dict[str, Any]  # rank 0's last report (:func:`last_report`)
    fresh: bool = True  # False: this fit reported nothing; ``metrics`` are an earlier fit's


def node_metrics_url(nodes: list[dict[str, Any]], node_id: str) -> str | None:
    """``http://<ip>:<port>/metrics`` of node ``node_id`` in ``ray.nodes()``, or None when it
    opened no metrics port: Ray then answers -1 (or 0), not an address to show."""
    for node in nodes:
        port = node.get("MetricsExportPort")
        if node.get("NodeID") == node_id and isinstance(port, int) and port > 0:
            return f"http://{host_port(node['NodeManagerAddress'], port)}/metrics"
    return None


def metrics_url() -> str | None:
    """:func:`node_metrics_url` of this driver's Ray node, or None."""
    try:
        return node_metrics_url(ray.nodes(), ray.get_runtime_context().get_node_id())
    except Exception:  # noqa: BLE001 - a summary line is not worth failing for
        return None


def run_job(job: Job, address: str | None = None, verbose: bool = False) -> Result:
    """Check the job, connect to Ray and run it to the end."""
    return run_job_outcome(job, address, verbose).result


def run_job_outcome(job: Job, address: str | None = None, verbose: bool = False) -> RunOutcome:
    """:func:`run_job`, with the wall time and where the metrics were served."""
    train_fn = job.load_train_fn()  # a train function that cannot be imported fails before Ray
    cpus = job.scaling.num_workers * float(
        (job.scaling.resources_per_worker or {}).get("CPU", 1))
    cpus += DATA_CPUS if job.data is not None else 0  # room for Ray Data's tasks
    # The storage (probed here, once), size, interfaces: before Ray starts.
    storage_path = check_before_ray(job, will_embed(address))
    with ray_session(address, cpus) as started, progress_tail() as tail:
        # Resources, the mesh against the worker count, a storage_path that some node cannot
        # see or write: all fail here, before the run's parts are put together.
        parts = run_parts(job, storage_path, train_fn=train_fn, verbose=verbose)
        trainer = parts.trainer()
        url = metrics_url()
        t0, since = time.monotonic(), time.time()
        try:
            result = trainer.fit()
        except Exception as exc:
            # A group that cannot start again (a node lost, a fixed-size run) -> say so.
            why = explain_startup_failure(exc, parts.scaling.num_workers)
            if why:
                raise JobError(why) from exc
            # Our own error (a failed pre-flight, a bad mesh) inside Ray's wrappers.
            ours = user_error_inside(exc, USER_ERROR_TYPES)
            if ours is not None:
                raise ours from None
            failed = train_function_failure(exc)  # the user's code raised: say where, once
            if failed is not None:
                raise TrainFunctionError(
                    f"its train function raised on {failed} (each rank's traceback is "
                    f"above)") from exc
            raise
        wall_s = time.monotonic() - t0
        metrics, fresh = last_report(result, since) if result.error is None else ({}, False)
        # The last progress line printed before the summary (and before ray.shutdown()):
        # only a line this fit printed.
        tail.wait(final_steps({job.name: metrics} if fresh else {},
                              parts.mesh_config.total_steps),
                  say=lambda line: print(f"ray-mesh: {line}", flush=True))
        return RunOutcome(result, wall_s, url, started, metrics, fresh)
