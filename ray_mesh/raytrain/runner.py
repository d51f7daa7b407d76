"""Run a :class:`~ray_mesh.cli.job.Job` on Ray: embedded local Ray, or a cluster by address."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import ray
from ray.train import CheckpointConfig, Result, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray_mesh.checkpointing.storage import check_run_name, check_storage
from ray_mesh.cli.job import Job, JobError
from ray_mesh.core.priority import RAY_NICENESS_ENV
from ray_mesh.core.spec import NODES
from ray_mesh.network.interfaces import host_port, split_host_port
from ray_mesh.raytrain.auth import secure_token_file
from ray_mesh.raytrain.backend import MeshConfig
from ray_mesh.raytrain.elastic import check_elastic_mesh, explain_startup_failure, failure_config

logger = logging.getLogger(__name__)


def connect(address: str | None, num_cpus_needed: float) -> bool:
    """Join ``address`` (or RAY_ADDRESS); with neither, start an embedded local Ray.

    Returns True when this call started Ray (the caller shuts it down).
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        secure_token_file(create=False)  # a token others can read: tightened, with a warning
        check_reachable(address)
        try:
            ray.init(address=address, log_to_driver=True)
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
    saved = os.environ.get(RAY_NICENESS_ENV)
    os.environ.setdefault(RAY_NICENESS_ENV, "0")
    # A new local Ray writes ~/.ray/auth_token with the umask (0644): create it first, 0600.
    secure_token_file(create=True)
    try:
        ray.init(address="local",
                 num_cpus=max(os.cpu_count() or 1, math.ceil(num_cpus_needed)))
    finally:
        if saved is None:
            os.environ.pop(RAY_NICENESS_ENV, None)
    secure_token_file(create=False)
    return True


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
            channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetClusterId")(
                b"", timeout=timeout_s)
            return
        except grpc.RpcError as exc:
            code, details = exc.code(), (exc.details() or "")[:200]
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


def scaling_for(job: Job, cluster: dict[str, float]) -> ScalingConfig:
    """ScalingConfig from the job, with use_gpu 'auto' meaning "if the cluster has enough"."""
    s = job.scaling
    workers = s.get("num_workers", 4)
    use_gpu = s.get("use_gpu", "auto")
    if use_gpu == "auto":
        use_gpu = cluster.get("GPU", 0) >= workers
    resources = dict(s.get("resources_per_worker") or {})
    if not use_gpu:
        resources.setdefault("CPU", 1)
    kwargs: dict[str, Any] = {}
    if "placement_strategy" in s:
        kwargs["placement_strategy"] = s["placement_strategy"]
    # run.min_workers makes the run elastic: Ray Train restarts it on (min..max) workers.
    min_workers = job.run.get("min_workers")
    return ScalingConfig(num_workers=(min_workers, workers) if min_workers else workers,
                         use_gpu=bool(use_gpu), resources_per_worker=resources or None, **kwargs)


def check_resources(scaling: ScalingConfig, cluster: dict[str, float]) -> None:
    """Fail now, not after a silent wait for resources that will never come."""
    per_worker = dict(scaling.resources_per_worker or {})
    if scaling.use_gpu:
        per_worker.setdefault("GPU", 1)
    for name, amount in per_worker.items():
        need = amount * scaling.min_workers
        have = cluster.get(name, 0)
        if need > have:
            fix = ("set scaling.use_gpu: false (or auto) to train on CPU"
                   if name == "GPU" else f"lower scaling.num_workers or resources_per_worker."
                   f"{name}, or add nodes that have {name!r}")
            raise JobError(
                f"The job asks for {name}: {need:g} ({scaling.min_workers} workers x {amount:g}) "
                f"but the cluster has {name}: {have:g}. {fix[0].upper() + fix[1:]}."
            )


def check_cluster(scaling: ScalingConfig) -> None:
    """Driver-side check of ``scaling`` against the connected cluster's total resources.

    Ray Train 2.60 waits forever ("worker group startup timed out", retried) when a
    ScalingConfig asks for resources the cluster does not have, e.g. GPUs on a CPU-only
    cluster, and no backend hook runs before that wait. Call this before ``fit()``.
    """
    check_resources(scaling, ray.cluster_resources())


def build_trainer(job: Job, scaling: ScalingConfig) -> TorchTrainer:
    net = job.network
    mesh_config = MeshConfig(
        mesh=job.mesh,
        interface=net.get("interface", "auto"),
        allow_cross_node_inner=bool(net.get("allow_cross_node_inner", False)),
        bringup_timeout_s=float(net.get("bringup_timeout_s", 120.0)),
        backend=net.get("backend"),
        timeout_s=int(net.get("timeout_s", 1800)),
        preflight=bool(net.get("preflight", True)),
        preflight_timeout_s=float(net.get("preflight_timeout_s", 20.0)),
        nccl_vpn_defaults=net.get("nccl_vpn_defaults", "auto"),
        replicate=job.replicate,
    )
    run = job.run
    run_config = RunConfig(
        name=check_run_name(job.name),
        storage_path=run.get("storage_path"),
        failure_config=failure_config(int(run.get("max_failures", 0)),
                                      int(run.get("startup_retries", 3))),
        checkpoint_config=CheckpointConfig(num_to_keep=run.get("num_to_keep")),
    )
    return TorchTrainer(
        job.load_train_fn(),
        train_loop_config=job.config,
        scaling_config=scaling,
        torch_config=mesh_config,
        run_config=run_config,
    )


def run_job(job: Job, address: str | None = None) -> Result:
    """Check the job, connect to Ray and run it to the end."""
    job.load_train_fn()  # a train function that cannot be imported fails before Ray starts
    cpus = job.scaling.get("num_workers", 4) * float(
        (job.scaling.get("resources_per_worker") or {}).get("CPU", 1))
    # Ray Train's run state API (what `ray-mesh status` reads) is off unless this is set
    # before the driver connects; an embedded Ray's processes inherit it too.
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    started = connect(address, cpus)
    try:
        cluster = ray.cluster_resources()
        scaling = scaling_for(job, cluster)
        check_resources(scaling, cluster)
        # A storage_path that is not writable, or node-local on a multi-node cluster, fails
        # here rather than at the first checkpoint.
        job.run["storage_path"] = check_storage(job.run.get("storage_path"), name=job.name)
        # Resolve the mesh against the worker count now: a product that cannot match fails
        # here, not after the workers started.
        if scaling.elasticity_enabled:
            check_elastic_mesh(job.mesh, scaling.min_workers, scaling.max_workers)
        elif NODES not in job.mesh.shape:
            job.mesh.resolve(scaling.num_workers)
        trainer = build_trainer(job, scaling)
        try:
            return trainer.fit()
        except Exception as exc:
            # A group that cannot start again (a node lost, a fixed-size run) -> say so.
            why = explain_startup_failure(exc, scaling.num_workers)
            if why:
                raise JobError(why) from exc
            raise
    finally:
        if started:
            ray.shutdown()
