"""Replica groups on Ray: one Ray Train run per ``dp_replicate`` index, and a coordinator.

Why one run per group, not Ray Train's own replica groups: Ray Train's controller can replace
a failed replica group alone (``WorkerGroup.replace_replica_group``), but only builds groups
of one worker (``replica_group_size=1``), so a group cannot hold a ``dp_shard`` x ``tp``
mesh (upstream: ray-train-replica-groups-one-worker). A Ray Train run per group gives
exactly the isolation wanted with public APIs only: its ``FailureConfig`` restarts that group
alone, ``STRICT_PACK`` keeps it on one node, and a node that does not come back leaves its
run waiting for resources while the others train.

* :class:`~ray_mesh.raytrain.replica_coordinator.Coordinator` (an actor on the driver's
  node): the run's :class:`~ray_mesh.replicas.quorum.Quorum` and the TCP store the
  cross-group process groups meet on (it outlives every group).
* :func:`fit_replica_groups`: starts the coordinator and one runner actor per group (each
  calls ``TorchTrainer.fit``), prints groups leaving and joining as they happen, and ends
  the runs still waiting for a node once the run is over (killing a runner ends its
  controller, workers and placement group with it: they are its children).
* :func:`replica_group`: in the train function, the :class:`~ray_mesh.replicas.ReplicaGroup`
  of this worker's group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from ray_mesh.core.diloco_config import check_group_compress
from ray_mesh.errors import GroupsFailed
from ray_mesh.raytrain.attempt_watch import AttemptWatch
from ray_mesh.raytrain.driver import (
    PREEMPTION_WATCHER_ENV,
    enable_state_tracking,
    warm_controller_actors,
)
from ray_mesh.raytrain.replica_client import CoordinatorClient
from ray_mesh.raytrain.replica_coordinator import Coordinator
from ray_mesh.raytrain.replica_storage import check_groups_storage, check_settings
from ray_mesh.replicas.layouts import GroupSpec, exchange_for, group_specs
from ray_mesh.replicas.shares import check_mode

logger = logging.getLogger(__name__)
CONFIG_KEY = "ray_mesh_replica_group"
INCARNATION = "incarnation"  # set by replica_group() in the worker: the attempt's id
ENDED_GRACE_S = 20.0  # after the last step: how long a group still starting may take to end
# A group failing this often without rejoining (or twice with the same error) is the code,
# not a node coming and going.
MAX_FAILS_IN_A_ROW = 3
STATUS_EVERY_S = 10.0  # the status file between events: shares and speeds move
NODE_PIN = 0.001  # of a node's node:<address> resource (1.0 in all), per worker of a group


def replica_group(model: Any, optimizer: Any, config: dict[str, Any], **kwargs: Any) -> Any:
    """In a train function started by :func:`fit_replica_groups`: this worker's
    :class:`~ray_mesh.replicas.ReplicaGroup` (``kwargs``: its options, e.g. ``diloco=``).

    Stability: experimental
    """
    from ray_mesh.replicas import ReplicaGroup

    rg = config[CONFIG_KEY]
    kwargs.setdefault("compress", rg.get("compress", "none"))  # the run's, unless given here
    client = CoordinatorClient(rg["coordinator"], rg["timeout_s"], rg["arrive_s"])
    group = ReplicaGroup(model, optimizer, client=client,
                         group_id=rg["group_id"], total_steps=rg["total_steps"],
                         segment_samples=rg["segment_samples"],
                         checkpoint_dir=rg["checkpoint_dir"],
                         checkpoint_every=rg["checkpoint_every"],
                         checkpoint_endpoint=rg.get("checkpoint_endpoint"),
                         checkpoint_keep=rg.get("checkpoint_keep"),
                         upload_timeout_s=rg.get("upload_timeout_s", 600.0),
                         exchange=rg["exchange"], layout=rg["layout"], **kwargs)
    # This worker's own copy of the config: _guarded names the attempt when it reports an
    # error, so the coordinator drops it at once instead of waiting for its beats to stop.
    rg[INCARNATION] = group.incarnation
    return group


def _guarded(train_fn: Any) -> Any:
    """``train_fn``, reporting its error to the coordinator before Ray Train sees it, so the
    driver's console says why a group failed (not only that it stopped beating)."""

    def run(config: dict[str, Any]) -> Any:
        try:
            return train_fn(config)
        except BaseException as exc:
            rg = config[CONFIG_KEY]
            text = (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0][:300]
            with contextlib.suppress(Exception):  # the error itself is what matters
                import ray.train

                rank = ray.train.get_context().get_world_rank()
                ray.get(rg["coordinator"].failed.remote(rg["group_id"], text, rank,
                                                        rg.get(INCARNATION)), timeout=5)
            raise

    return run


@ray.remote(num_cpus=0)
class _GroupRunner:
    """Runs one group's ``TorchTrainer.fit`` (its controller and workers are this actor's
    children, so killing the runner ends them)."""

    def fit(self, train_fn: Any, config: dict[str, Any], trainer_kwargs: dict[str, Any],
            train_env: dict[str, str] | None = None) -> dict[str, Any]:
        from ray.train.torch import TorchTrainer

        os.environ.update(train_env or {})  # before fit() reads them: see _train_env
        since = time.time()
        result = TorchTrainer(train_fn, train_loop_config=config, **trainer_kwargs).fit()
        # Ray Train keeps a report's metrics in Result only with a checkpoint: the last
        # report is also in the summary ray_mesh saves in the run's directory
        # (upstream: ray-train-result-metrics-need-checkpoint); "fresh": this fit's
        # (observability.report.last_report).
        from ray_mesh.observability.report import last_report

        metrics, fresh = last_report(result, since)
        return {"metrics": metrics, "fresh": fresh,
                "error": repr(result.error) if result.error else None}


@dataclass
class ReplicaGroupsResult:
    """What :func:`fit_replica_groups` returns."""

    # per group: its last reported metrics, or why it ended ("error"), or why it was not
    # there at the end ("absent": its node had not come back)
    groups: dict[int, dict[str, Any]]
    status: dict[str, Any]              # the coordinator's books: events, step, samples used
    events: list[dict[str, Any]] = field(default_factory=list)


def _train_env() -> dict[str, str]:
    """The driver's Ray Train settings (``RAY_TRAIN_*``; ``ray-mesh run`` sets
    ``driver.CLI_ENV``), for each group's ``fit()``. Ray Train hands them from the process
    that calls ``fit()`` to its controller and workers; a group's ``fit()`` runs in a runner
    actor, whose environment on a cluster is its raylet's (``ray start``'s), not the
    driver's. Without them the print patch stays on in the groups' workers (every line a
    train function prints reaches the console twice; upstream: ray-train-print-patch-twice)
    and reports wait for the 2 s health check (upstream: ray-train-report-queue-of-one). An
    embedded Ray inherits the driver's environment, so it has them.

    No preemption watcher, unless the user asked for one: a group's loss of a node is its
    quorum's business (Ray Train skips the watcher for its own replica groups, TorchFT's, for
    the same reason). Each watcher is one more actor per group start, importing Ray Train
    (~2 s of CPU), whose start logs a core-worker error line about its constructor's
    arguments on every console (upstream: ray-train-preemption-watcher)."""
    return {PREEMPTION_WATCHER_ENV: "0",
            **{k: v for k, v in os.environ.items() if k.startswith("RAY_TRAIN_")}}


def _pinned_here() -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(),
                                          soft=False)


def fit_replica_groups(train_fn: Any, *,
                       groups: int | str | list[GroupSpec | dict[str, Any]],
                       workers_per_group: int | None = None, total_steps: int,
                       segment_samples: int, mesh_config: Any = None,
                       config: dict[str, Any] | None = None, name: str = "replica-groups",
                       storage_path: str | None = None, storage_endpoint: str | None = None,
                       resources_per_worker: dict[str, float] | None = None,
                       use_gpu: bool = False, max_group_failures: int = 20,
                       checkpoint_every: int = 0, checkpoint_dir: str | None = None,
                       num_to_keep: int | None = None, upload_timeout_s: float = 600.0,
                       dead_after_s: float = 5.0, arrive_timeout_s: float = 300.0,
                       timeout_s: float = 30.0, poll_s: float = 0.5, shares: str = "equal",
                       on_event: Any = None, on_groups: Any = None,
                       storage_probed: bool = False, compress: str = "none"
                       ) -> ReplicaGroupsResult:
    """Train ``train_fn`` as ``groups`` replica groups of ``workers_per_group`` workers, or
    as one group per entry of a list of group layouts (unequal boxes:
    :func:`~ray_mesh.replicas.layouts.group_specs`, e.g. ``[{"dp_shard": 2}, {"mesh":
    {"dp_shard": 1}, "node": "100.64.0.3"}]``; groups of different layouts exchange full
    tensors, :mod:`ray_mesh.replicas.reshard`), or ``"auto"``: one group per alive node
    over all its devices (:func:`~ray_mesh.planning.groups.groups_from_nodes`).

    Each group is a Ray Train run of its own (``name``-g<i>), packed on one node (its own
    node when the layout names one), with ``mesh_config`` (a :class:`~ray_mesh.MeshConfig`
    for the group's inner mesh; default: ``dp_shard`` over its workers; with a list of
    layouts, its other settings with each group's mesh) and a budget of
    ``max_group_failures`` restarts. The train
    function gets ``config`` and builds its group with :func:`replica_group`. ``on_event``
    (default: log) sees each membership event as the coordinator records it; ``on_groups``
    (default: log) the groups' line (layouts, nodes) before they start.
    ``compress`` (``none``, ``bf16`` or ``int8`` with error feedback) is how each step's
    gradients cross between the groups (a VPN link: ``int8`` sends a quarter of float32's
    bytes); a train function using DiLoCo sets its own in ``DiLoCoConfig``.
    ``shares="speed"`` sizes each group's segment to its measured speed (unequal boxes:
    :mod:`ray_mesh.replicas.shares`); the default gives every group ``segment_samples``.

    Storage: ``storage_path`` (a directory, or a bucket URI with ``storage_endpoint`` for an
    S3-compatible server) holds each group's run and, every ``checkpoint_every`` steps, the
    run's fallback checkpoint (restored when every group is gone at once): in
    ``<storage_path>/<name>-fallback`` unless ``checkpoint_dir`` names another place,
    written locally and uploaded in the background (:mod:`ray_mesh.replicas.fallback`;
    ``upload_timeout_s`` bounds one upload), the ``num_to_keep`` newest kept (None: all).
    The storage is probed from the driver and every alive node before anything starts
    (:mod:`ray_mesh.raytrain.replica_storage`; ``storage_probed``: this process probed it
    before Ray started, as ``ray-mesh run`` does, so only the nodes probe it now).
    ``max_group_failures``: restarts of one group (-1: no limit).

    Stability: experimental
    """
    from ray.train import FailureConfig, ScalingConfig

    from ray_mesh.raytrain.launch import run_config

    check_settings(checkpoint_every=checkpoint_every, num_to_keep=num_to_keep,
                   max_group_failures=max_group_failures, upload_timeout_s=upload_timeout_s)
    check_mode(shares)
    check_group_compress(compress, False)
    if groups != "auto":
        group_specs(groups, workers_per_group)  # the layouts' text first: nothing contacted
    storage = {"storage_path": storage_path, "storage_endpoint": storage_endpoint,
               "name": name, "checkpoint_every": checkpoint_every,
               "checkpoint_dir": checkpoint_dir}
    if not storage_probed:  # from here, before Ray is asked anything
        check_groups_storage(**storage, where="driver")
    if groups == "auto":  # one group per alive node, as many workers as it has room for
        specs = _groups_of_this_cluster(resources_per_worker, use_gpu)
    else:
        specs = group_specs(groups, workers_per_group)  # on the driver, before any actor
    _check_room(specs, resources_per_worker, use_gpu)
    exchange = exchange_for(specs)
    # Run-state tracking for `ray-mesh status`, decided here: MeshConfig decides it at fit(),
    # which here runs in the runner actors (_train_env hands them the driver's choice).
    enable_state_tracking()
    # The coordinator's and the runners' processes start while the nodes are checked (the
    # storage from every node, ray_mesh's import there): each start is a few seconds of the
    # run's start on a busy machine, and a slow node's answer as long. A check that fails
    # stops them again.
    coordinator = Coordinator.options(scheduling_strategy=_pinned_here()).remote(
        segment_samples, total_steps, dead_after_s, arrive_timeout_s, len(specs), name, shares,
        getattr(mesh_config, "worker_niceness", 0))
    runners = {gid: _GroupRunner.options(scheduling_strategy=_pinned_here()).remote()
               for gid in range(len(specs))}
    try:
        location, location_endpoint = check_groups_storage(**storage, where="nodes")
        line = "replica groups: " + "; ".join(f"group {i}: {s.label}" + (
            f" on {s.node}" if s.node else "") for i, s in enumerate(specs))
        (on_groups or logger.info)(line)
        warm_controller_actors()  # the groups' controllers run on this node (_pinned_here)
        ray.get(coordinator.store_address.remote(), timeout=60)
    except BaseException:
        for actor in (coordinator, *runners.values()):
            ray.kill(actor)
        raise
    emit = on_event or (lambda e: logger.info("%s", describe(e)))
    refs = {}
    for gid, spec in enumerate(specs):
        run_cfg = {**(config or {}), CONFIG_KEY: {
            "coordinator": coordinator, "group_id": gid, "total_steps": total_steps,
            "segment_samples": segment_samples, "timeout_s": timeout_s,
            "arrive_s": arrive_timeout_s + dead_after_s + 60.0,  # see CoordinatorClient
            "checkpoint_dir": location, "checkpoint_every": checkpoint_every,
            "checkpoint_endpoint": location_endpoint, "checkpoint_keep": num_to_keep,
            "upload_timeout_s": upload_timeout_s,
            "exchange": exchange, "layout": spec.label, "compress": compress}}
        per_worker = dict(resources_per_worker or {})
        if spec.node:  # Ray's own node:<address> resource pins the group to that node
            per_worker[f"node:{spec.node}"] = NODE_PIN
        trainer_kwargs = {
            "scaling_config": ScalingConfig(num_workers=spec.workers, use_gpu=use_gpu,
                                            placement_strategy="STRICT_PACK",
                                            resources_per_worker=per_worker or None),
            "torch_config": _group_mesh_config(mesh_config, spec, groups),
            "run_config": run_config(f"{name}-g{gid}", storage_path, storage_endpoint,
                                     failure=FailureConfig(max_failures=max_group_failures),
                                     num_to_keep=num_to_keep,
                                     # Ray Train's INFO lines (state transitions, worker
                                     # group starts) as for one mesh: with verbose only
                                     verbose=bool(getattr(mesh_config, "verbose", False)),
                                     callbacks=[AttemptWatch(coordinator, gid)]),
        }
        refs[gid] = runners[gid].fit.remote(_guarded(train_fn), run_cfg, trainer_kwargs,
                                            _train_env())
    results: dict[int, dict[str, Any]] = {}
    groups = len(specs)
    seen, ended_at, written = 0, None, time.monotonic()
    fails: dict[int, list[str]] = {}
    while len(results) < groups:
        ready, _ = ray.wait([r for g, r in refs.items() if g not in results],
                            timeout=poll_s)
        for ref in ready:
            gid = next(g for g, r in refs.items() if r == ref)
            try:
                results[gid] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - reported per group, the run goes on
                results[gid] = {"metrics": None, "error": repr(exc)}
        status = ray.get(coordinator.status.remote(), timeout=60)
        for event in status["events"][seen:]:
            emit(event)
            if event["kind"] == "failed":
                fails.setdefault(event["group"], []).append(event["detail"])
            elif event["kind"] in ("joined", "healed"):
                fails.pop(event["group"], None)
        if len(status["events"]) != seen or time.monotonic() - written > STATUS_EVERY_S:
            # events, shares and speeds
            _write_status(storage_path, name, groups, status, storage_endpoint)
            written = time.monotonic()
        seen = len(status["events"])
        stuck = {g: f for g, f in fails.items()
                 if len(f) >= MAX_FAILS_IN_A_ROW or (len(f) >= 2 and f[-1] == f[-2])}
        if stuck:
            _write_status(storage_path, name, groups, status, storage_endpoint)
            for r in runners.values():
                ray.kill(r)
            ray.kill(coordinator)
            gid, errors = next(iter(stuck.items()))
            raise GroupsFailed(
                f"replica group {gid} failed {len(errors)} times in a row without rejoining, "
                f"last with: {errors[-1]}. That is the train function or the group's setup, "
                f"not a node coming and going: fix it and start the run again (the other "
                f"groups were stopped too)")
        if status["finished"] and ended_at is None:
            ended_at = time.monotonic()
        if ended_at is not None and time.monotonic() - ended_at > ENDED_GRACE_S:
            for gid in set(refs) - set(results):  # still waiting for a node: end it
                # not an error: every step was taken, by the others (its box never came
                # back in time); the run's exit status stays that of its training
                ray.kill(runners[gid])
                results[gid] = {"metrics": None, "error": None, "absent": "its node did not "
                                "come back before the run finished"}
    status = ray.get(coordinator.status.remote(), timeout=60)
    _write_status(storage_path, name, groups, status, storage_endpoint)
    for r in runners.values():
        ray.kill(r)
    ray.kill(coordinator)
    return ReplicaGroupsResult(groups=results, status=status, events=status["events"])


def _check_room(specs: list[GroupSpec], resources_per_worker: dict[str, float] | None,
                use_gpu: bool) -> None:
    """Each group fits a node of this cluster (planning.groups.check_room): no silent wait."""
    from ray_mesh.planning.cluster import nodes_from_ray
    from ray_mesh.planning.groups import check_room

    per = dict(resources_per_worker or {})
    per.setdefault("GPU" if use_gpu else "CPU", 1.0)  # what ScalingConfig asks by default
    check_room(specs, per, nodes_from_ray(ray.nodes()))


def _groups_of_this_cluster(resources_per_worker: dict[str, float] | None,
                            use_gpu: bool) -> list[GroupSpec]:
    """``groups="auto"``: one group per alive node (planning.groups.groups_from_nodes), by
    GPUs, else by the custom resource a worker asks for, else by CPUs."""
    from ray_mesh.planning.cluster import nodes_from_ray
    from ray_mesh.planning.groups import groups_from_nodes

    per = dict(resources_per_worker or {})
    custom = [k for k in per if k not in ("CPU", "GPU", "memory")]
    resource = "GPU" if use_gpu else (custom[0] if custom else "CPU")
    return groups_from_nodes(nodes_from_ray(ray.nodes()), resource, per.get(resource, 1.0))


def _group_mesh_config(given: Any, spec: GroupSpec, groups: Any) -> Any:
    """A group's MeshConfig: ``given`` as is for ``groups=N`` (default: ``dp_shard`` over
    the group), else ``given``'s settings with the group's own mesh."""
    import dataclasses

    from ray_mesh.raytrain.backend import MeshConfig

    uniform = isinstance(groups, int)
    if given is None:
        return MeshConfig(mesh={"dp_shard": -1} if uniform else dict(spec.mesh))
    if uniform:
        return given
    return dataclasses.replace(given, mesh=dict(spec.mesh), layout=None, replicate=None)


def _write_status(storage_path: str | None, name: str, groups: int,
                  status: dict[str, Any], endpoint: str | None = None) -> None:
    """The groups' events into each group's run directory, for ``ray-mesh status``: a local
    or shared directory, or the run's bucket (at ``endpoint``; each request bounded)."""
    if storage_path is None:
        return
    from ray_mesh.observability import replica_groups as groups_file

    for gid in range(groups):
        try:
            groups_file.write(f"{storage_path.rstrip('/')}/{name}-g{gid}", status, endpoint)
        except (OSError, ValueError) as exc:  # a full disk or a bucket away must not stop
            logger.warning("replica groups: status file not written (%s)", exc)  # training
            return


PHRASES = {"paces": "sets the pace"}  # an event's kind as the console line says it


def describe(event: dict[str, Any]) -> str:
    """One console line for a membership event."""
    kind = PHRASES.get(event["kind"], event["kind"])
    return f"replica group {event['group']} {kind} at step {event['step']}: {event['detail']}"


__all__ = ["fit_replica_groups", "replica_group"]
