"""One launch layer: a checked job becomes the parts of a run, one mesh or replica groups.

``ray-mesh run`` builds every run here, in two steps:

* :func:`probe_storage`, before Ray starts: the driver's one probe of the run's storage
  (and, for replica groups, of the fallback checkpoints' place when it lies elsewhere).
* :func:`run_parts`, connected: the :class:`RunParts` (the train function and its config,
  the ``MeshConfig``, the ``ScalingConfig``, the ``RunConfig`` with the storage path and
  endpoint, the Ray Data datasets, the replica-group settings), from the job as parsed.
  Before it builds a one-mesh run it checks the cluster's resources, the mesh against the
  workers, and the nodes' half of the storage probe (replica groups:
  ``fit_replica_groups`` checks each group's room and asks the nodes, told the driver
  probed already).

So a job file is parsed once and its storage probed once per place, and every job key
either reaches the parts of both shapes or is refused by name when the job is parsed
(``cli.job_groups.check_alongside``); ``tests/unit/test_launch.py`` walks every key.

The job is a :class:`ray_mesh.cli.job.Job`, read by its fields (``cli`` sits above this
layer). A Python driver builds the same parts itself: ``RunConfig(name=...,
**ray_mesh.run_storage(path, endpoint))`` for one mesh (or :func:`run_config`), and
``fit_replica_groups(..., storage_path=, storage_endpoint=, num_to_keep=)`` for groups.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.train import CheckpointConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray_mesh.checkpointing.storage import (
    absolute_storage_path,
    check_run_name,
    check_storage,
    check_storage_nodes,
)
from ray_mesh.core.object_store import run_storage
from ray_mesh.core.spec import NODES
from ray_mesh.errors import JobError
from ray_mesh.raytrain.backend import MeshConfig
from ray_mesh.raytrain.elastic import check_elastic_mesh, failure_config

logger = logging.getLogger(__name__)


@dataclass
class RunParts:
    """What a run is made of, built once from a checked job (see the module docstring).

    One mesh: ``scaling``, ``run_config`` and ``datasets`` make its ``TorchTrainer``
    (:meth:`trainer`). Replica groups: ``groups`` holds the rest of
    ``fit_replica_groups``' keyword arguments (layouts, steps, shares, fallback
    checkpoints, restarts, resources), and each group's ``RunConfig`` is made there from
    ``name``, ``storage_path`` and ``storage_endpoint`` by :func:`run_config`.
    """

    name: str
    train_fn: Callable[..., Any]
    config: dict[str, Any]  # the train function's config (data: and its index included)
    mesh_config: MeshConfig
    storage_path: str | None  # probed by the driver (None: Ray Train's default, groups)
    storage_endpoint: str | None
    scaling: ScalingConfig | None = None  # one mesh
    run_config: RunConfig | None = None  # one mesh
    datasets: dict[str, Any] | None = None  # one mesh with data: (Ray Data)
    groups: dict[str, Any] | None = None  # replica groups: fit_replica_groups' kwargs

    def trainer(self) -> TorchTrainer:
        """The one-mesh run's ``TorchTrainer``."""
        return TorchTrainer(self.train_fn, train_loop_config=self.config,
                            datasets=self.datasets, scaling_config=self.scaling,
                            torch_config=self.mesh_config, run_config=self.run_config)

    def groups_kwargs(self) -> dict[str, Any]:
        """``fit_replica_groups``' keyword arguments (the console's callbacks aside): the
        driver probed the storage before Ray started, so only the nodes probe it there."""
        return {**self.groups, "mesh_config": self.mesh_config, "config": self.config,
                "name": self.name, "storage_path": self.storage_path,
                "storage_endpoint": self.storage_endpoint, "storage_probed": True}


def run_config(name: str, storage_path: str | None, storage_endpoint: str | None, *,
               failure: Any, num_to_keep: int | None, verbose: bool | None = None,
               callbacks: list[Any] | None = None) -> RunConfig:
    """A run's ``RunConfig``: its storage (with ``storage_endpoint``: an ``S3FileSystem``
    at that endpoint, no credentials in it, and the path inside it), ``failure`` (a
    ``FailureConfig``), the ``num_to_keep`` newest checkpoints; ``verbose`` not None: Ray
    Train's own INFO lines (state transitions, every report) only when True; ``callbacks``:
    ``ray.train.UserCallback``s for its controller. ``name`` is checked by the caller
    (:func:`~ray_mesh.checkpointing.storage.check_run_name`)."""
    extra = {} if verbose is None else {
        "logging_config": LoggingConfig(log_level="INFO" if verbose else "WARNING")}
    return RunConfig(name=name, **run_storage(storage_path, storage_endpoint),
                     failure_config=failure,
                     checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep),
                     callbacks=callbacks, **extra)


def probe_storage(job: Any) -> str:
    """Before Ray starts: the driver probes the job's storage (a local path, or a bucket:
    endpoint, bucket, credentials, a write) and, for replica groups with fallback
    checkpoints elsewhere, their place; returns the checked storage path."""
    section = job.replica_groups
    if section is not None:
        from ray_mesh.raytrain.replica_storage import check_groups_storage

        check_groups_storage(storage_path=job.run.storage_path,
                             storage_endpoint=job.run.storage_endpoint, name=job.name,
                             checkpoint_every=section.checkpoint_every,
                             checkpoint_dir=section.checkpoint_dir, where="here")
        return absolute_storage_path(job.run.storage_path)
    return check_storage(job.run.storage_path, name=job.name,
                         endpoint=job.run.storage_endpoint, nodes=False)


def scaling_for(job: Any, cluster: dict[str, float]) -> ScalingConfig:
    """ScalingConfig from the job, with use_gpu 'auto' meaning "if the cluster has enough"."""
    s = job.scaling
    use_gpu = s.use_gpu
    if use_gpu == "auto":
        use_gpu = cluster.get("GPU", 0) >= s.num_workers
    resources = dict(s.resources_per_worker or {})
    if not use_gpu:
        resources.setdefault("CPU", 1)
    kwargs: dict[str, Any] = {}
    if s.placement_strategy is not None:
        kwargs["placement_strategy"] = s.placement_strategy
    # run.min_workers makes the run elastic: Ray Train restarts it on (min..max) workers.
    min_workers = job.run.min_workers
    return ScalingConfig(num_workers=(min_workers, s.num_workers) if min_workers
                         else s.num_workers,
                         use_gpu=bool(use_gpu), resources_per_worker=resources or None, **kwargs)


def mesh_config(job: Any, verbose: bool = False) -> MeshConfig:
    """The job's ``mesh``/``layout`` and ``network`` sections as a :class:`MeshConfig`; the
    job's ``config.steps`` (when a whole number) sizes the progress line's ``step i/N`` and
    ETA. Replica groups: ``dp_shard`` over each group (its layout replaces it) and the
    section's ``steps``."""
    if job.replica_groups is not None:
        return MeshConfig(mesh={"dp_shard": -1}, total_steps=job.replica_groups.steps,
                          **job.network.mesh_config_kwargs(verbose))
    where = ({"mesh": "auto", "replicate": job.replicate} if job.layout is None
             else {"layout": job.layout})
    steps = (job.config or {}).get("steps")
    total = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 \
        else None
    return MeshConfig(plan=job.plan, total_steps=total, **where,
                      **job.network.mesh_config_kwargs(verbose))


def groups_use_gpu(job: Any, cluster: dict[str, float]) -> bool:
    """``scaling.use_gpu`` for replica groups ('auto': a GPU for every listed worker)."""
    use_gpu = job.scaling.use_gpu
    if use_gpu == "auto":
        return cluster.get("GPU", 0) >= (job.replica_groups.workers() or 1)
    return bool(use_gpu)


def groups_config(job: Any, verbose: bool = False,
                  say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The groups' train function config: the job's, with its ``data:`` section and how
    to read it by index (``config["data_index"]``, :func:`ray_mesh.data.group_samples`):
    the driver's manifest of the files, or with ``data_from: ray_data`` the rows read once
    into Ray's object store (inside the Ray session; Ray Data's own log lines only with
    ``verbose``; ``say`` gets one line on what was read)."""
    if job.data is None:
        return job.config
    from ray_mesh.data.indexed import INDEX_KEY, manifest

    if job.replica_groups.data_from == "ray_data":
        from ray_mesh.data.indexed_ray import ray_samples

        node = ray.get_runtime_context().get_node_id()
        cpus = next((n.get("Resources", {}).get("CPU", 0) for n in ray.nodes()
                     if n.get("NodeID") == node), 0)
        if cpus < 1:
            raise JobError(
                "replica_groups.data_from: ray_data reads the data on the driver's node, "
                "which has no CPU for Ray Data's tasks. Run the driver on a node with a CPU, "
                "or use data_from: files.")
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
        (say or logger.info)(f"data: {len(index['samples'])} training rows read into the "
                             f"object store in {time.monotonic() - t0:.1f} s "
                             f"(data_from: ray_data)")
    else:
        index = {"manifest": manifest(job.data)}
    return {**job.config, "data": job.data.to_dict(), INDEX_KEY: index}


def _with_data(job: Any) -> dict[str, Any]:
    """The train function's config with the checked ``data:`` section under ``"data"``."""
    return job.config if job.data is None else {**job.config, "data": job.data.to_dict()}


def run_parts(job: Any, storage_path: str | None, *, cluster: dict[str, float] | None = None,
              train_fn: Callable[..., Any] | None = None, verbose: bool = False,
              say: Callable[[str], None] | None = None, connected: bool = True) -> RunParts:
    """The parts of ``job``'s run (see :class:`RunParts`); ``storage_path``:
    :func:`probe_storage`'s. Connected to Ray (the default), a one-mesh run is checked
    against the cluster first (resources, Ray Data's CPU, the mesh against the workers,
    every node's half of the storage probe; replica groups: ``fit_replica_groups`` checks
    each group's room and asks the nodes). ``connected=False`` (``cluster``: its
    resources) builds the parts alone and reads no data through Ray (Ray Data starts a
    Ray): the train function's config still carries the ``data:`` section."""
    check_run_name(job.name)  # a Job built in Python skips the file's checks
    if cluster is None:
        cluster = ray.cluster_resources() if connected else {}
    train_fn = train_fn or job.load_train_fn()
    run = job.run
    section = job.replica_groups
    if section is not None:
        config = (groups_config(job, verbose, say)
                  if connected or section.data_from == "files" else _with_data(job))
        groups = {**section.fit_kwargs(), "num_to_keep": run.num_to_keep,
                  "resources_per_worker": dict(job.scaling.resources_per_worker or {}) or None,
                  "use_gpu": groups_use_gpu(job, cluster)}
        return RunParts(job.name, train_fn, config, mesh_config(job, verbose),
                        storage_path if run.storage_path is not None else None,
                        run.storage_endpoint, groups=groups)
    scaling = scaling_for(job, cluster)
    mesh = mesh_config(job, verbose)
    if connected:
        check_data_resources(job, scaling, cluster)
        check_cluster(scaling, mesh)  # resources, the mesh against the worker count
        check_storage_nodes(storage_path, endpoint=run.storage_endpoint)
    rc = run_config(job.name, storage_path, run.storage_endpoint,
                    failure=failure_config(run.max_failures, run.startup_retries),
                    num_to_keep=run.num_to_keep, verbose=verbose)
    datasets, config = job.trainer_inputs() if connected else (None, _with_data(job))
    return RunParts(job.name, train_fn, config, mesh, storage_path, run.storage_endpoint,
                    scaling=scaling, run_config=rc, datasets=datasets)


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


def check_cluster(scaling: ScalingConfig, torch_config: MeshConfig | None = None,
                  storage_path: str | None = None, *, check_store: bool = False,
                  name: str | None = None, storage_endpoint: str | None = None) -> str | None:
    """Driver-side checks before ``fit()``; ``ray-mesh run`` makes the same ones.

    Ray Train waits forever ("worker group startup timed out", retried) when a
    ScalingConfig asks for resources the cluster does not have, e.g. GPUs on a CPU-only
    cluster, and no backend hook runs before that wait: these checks need the
    ScalingConfig and RunConfig, which a ``BackendConfig`` never sees on the driver
    (upstream: ray-train-start-waits-forever).

    Checks ``scaling`` against the connected cluster's resources; with ``torch_config``, that
    its mesh can be laid out on the worker count (elastic ranges included); with
    ``check_store`` (or a ``storage_path``), that the storage path is writable and shared by
    every node (and ``name``, the run name, that it stays inside it); ``storage_endpoint``:
    the S3-compatible server of an ``s3://`` storage path. Returns the checked storage path.

    Stability: stable
    """
    check_resources(scaling, ray.cluster_resources())
    if torch_config is not None and torch_config.mesh != "auto":  # auto: planned at bring-up
        if scaling.elasticity_enabled:
            check_elastic_mesh(torch_config.mesh, scaling.min_workers, scaling.max_workers)
        elif NODES not in torch_config.mesh.shape:
            torch_config.mesh.resolve(scaling.num_workers)
    if check_store or storage_path is not None:
        return check_storage(storage_path, name=name, endpoint=storage_endpoint)
    return storage_path


def check_data_resources(job: Any, scaling: ScalingConfig, cluster: dict[str, float]) -> None:
    """A ``data:`` job streams through Ray Data tasks, which need CPUs the workers leave free:
    without one the read waits for resources forever and the first step never comes."""
    if job.data is None:
        return
    per = dict(scaling.resources_per_worker or {}).get("CPU", 0 if scaling.use_gpu else 1)
    free = cluster.get("CPU", 0) - per * scaling.max_workers
    if free < 1:
        raise JobError(
            f"The job's data: section streams through Ray Data, whose read tasks need a free "
            f"CPU, but the {scaling.max_workers} workers take {per * scaling.max_workers:g} of "
            f"the cluster's {cluster.get('CPU', 0):g} CPUs. Lower scaling.resources_per_worker"
            f".CPU (e.g. 0.5) or num_workers, or add a node with CPUs.")


__all__ = ["check_cluster"]
