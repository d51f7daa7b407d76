"""What each Ray Train worker runs at bring-up and shutdown, decided by the controller.

``MeshConfig``'s backend (``ray_mesh.raytrain.backend``) plans the mesh on the controller and
sends each worker one :class:`WorkerSetup`; :func:`setup_on_worker` applies it inside the
worker actor: niceness first (the process group's threads inherit it), the environment,
the process group and the mesh, built for the run's layout (the Ray-free core: the layout
is held by the mesh and its state, nothing else), then the worker's observability
(``observability.owner``: report recorder, hang watch, wait sampler, started in that order and
stopped in reverse before the mesh goes).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from ray_mesh.core import bootstrap, priority
from ray_mesh.core.layout import Layout
from ray_mesh.core.options import MeshOptions
from ray_mesh.network.interfaces import Choice, apply_env, rank_env_line, user_kept
from ray_mesh.observability import active
from ray_mesh.observability.owner import Observability, ObservabilitySettings
from ray_mesh.planning.trial import StepFactory, run_trials
from ray_mesh.raytrain.driver import quiet_report_lines

logger = logging.getLogger("ray_mesh.raytrain.backend")  # the name users filter on


@dataclass(frozen=True)
class Placement:
    """Where one worker sits in the run: its ranks, node, device and network."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    device: str
    choice: Choice  # its interface and address
    fixed_env: dict[str, str]  # MASTER_ADDR/PORT: always ours
    collective_env: dict[str, str]  # NCCL_/GLOO_*: a value the user set wins


@dataclass(frozen=True)
class WorkerSetup:
    """Everything one worker needs to join the mesh, decided on the controller: where it
    sits, the run's layout (its mesh resolved), the run's options as the user gave them, and
    Ray's ``TorchConfig`` fields. Passed whole, not copied field by field."""

    placement: Placement
    layout: Layout  # the run's layout: resolved mesh, reduce dtype, pipeline, replicate mode
    options: MeshOptions  # niceness, hang watch, wait sampler, verbosity
    backend: str | None
    timeout_s: float
    total_steps: int | None = None  # for the progress line (MeshConfig.total_steps)
    layout_table: str = ""  # rank 0 logs it, with the per-node interface lines
    links: list[dict[str, Any]] | None = None  # the measured matrix; rank 0 exports it
    picked: str = ""  # why mesh="auto" picked the layout ("" for a fixed mesh)

    @property
    def rank(self) -> int:
        return self.placement.rank


def _prepare(w: WorkerSetup) -> tuple[priority.NicenessResult | None, dict[str, str]]:
    """Niceness (first, so the process group's threads inherit it) and the environment;
    returns the niceness result and the environment in force. Twice is harmless (the trials
    of ``mesh="auto"`` run before the mesh's own set-up)."""
    p, nice = w.placement, w.options.worker_niceness
    niced = priority.set_niceness(nice) if nice is not None else None
    os.environ.update(p.fixed_env)
    os.environ.update(RANK=str(p.rank), WORLD_SIZE=str(p.world_size),
                      LOCAL_RANK=str(p.local_rank), LOCAL_WORLD_SIZE=str(p.local_world_size),
                      NODE_RANK=str(p.node_rank))
    applied = apply_env(p.collective_env)
    return niced, applied


def trial_on_worker(w: WorkerSetup, layouts: list[Layout], step: StepFactory,
                    config: dict, steps: int, budget_s: float) -> list[dict[str, Any]]:
    """``mesh="auto"`` with ``plan.step``: join the world process group (kept for the mesh
    built next) and time the job's step on each candidate (``ray_mesh.planning.trial``)."""
    _prepare(w)
    p = w.placement
    dev, _ = bootstrap.join_world(w.backend, p.local_rank, p.device, p.rank, p.world_size,
                                  w.timeout_s)
    trials = run_trials(layouts, step, config, steps=steps, budget_s=budget_s,
                        device_type=dev.type, log=_log_line if w.rank == 0 else None)
    return [t.to_json() for t in trials]


def _log_line(line: str) -> None:
    logger.info("%s", line)  # once on the driver's console (see setup_on_worker)


def setup_on_worker(w: WorkerSetup) -> priority.NicenessResult | None:
    niced, applied = _prepare(w)
    p, opts = w.placement, w.options
    in_force = {**p.fixed_env, **applied}
    line = rank_env_line(p.rank, p.node_rank, p.choice, in_force,
                         user_kept(p.collective_env, applied))
    # Logging, not print: Ray Train shows a worker's INFO line once on the driver's console
    # (a print would show twice). Only rank 0 speaks unless MeshConfig(verbose=True).
    logger.log(logging.INFO if opts.verbose else logging.DEBUG, "%s", line)
    if not opts.verbose:
        quiet_report_lines()  # Ray Train's INFO line per report (not under its log level)
    bootstrap.setup_worker(w.layout.mesh, rank=p.rank, world_size=p.world_size,
                           local_rank=p.local_rank, backend=w.backend, device=p.device,
                           timeout_s=w.timeout_s, env=in_force, layout=w.layout,
                           picked=w.picked)
    Observability(ObservabilitySettings(
        opts, pg_timeout_s=w.timeout_s, links=w.links if p.rank == 0 else None,
        total_steps=w.total_steps)).start(bootstrap.get_mesh(), rank=p.rank,
                                          device=bootstrap.get_state().device)
    if w.rank == 0:
        logger.info("%s", w.layout_table)
    return niced


def shutdown_on_worker() -> None:
    owner = active.current()
    if owner is not None:  # None after a bring-up that failed before it
        owner.stop()
    bootstrap.shutdown_mesh()
