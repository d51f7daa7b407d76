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
from ray_mesh.core.spec import MeshSpec
from ray_mesh.network.interfaces import Choice, apply_env, rank_env_line, user_kept
from ray_mesh.observability import active
from ray_mesh.observability.owner import Observability, ObservabilitySettings
from ray_mesh.planning.trial import StepFactory, run_trials
from ray_mesh.raytrain.driver import quiet_report_lines

logger = logging.getLogger("ray_mesh.raytrain.backend")  # the name users filter on


@dataclass(frozen=True)
class WorkerSetup:
    """Everything one worker needs to join the mesh, decided on the controller."""

    spec: MeshSpec
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    fixed_env: dict[str, str]  # MASTER_ADDR/PORT: always ours
    collective_env: dict[str, str]  # NCCL_/GLOO_*: a value the user set wins
    backend: str | None
    device: str
    timeout_s: float
    choice: Choice
    layout_table: str  # rank 0 logs it, with the per-node interface lines
    niceness: int | None = None
    hang_timeout_s: float | None = None
    wait_sample_s: float | None = None
    links: list[dict[str, Any]] | None = None  # the measured matrix; rank 0 exports it
    verbose: bool = False
    layout: Layout = Layout()  # the run's layout (reduce dtype, pipeline, replicate mode)
    picked: str = ""  # why mesh="auto" picked the layout ("" for a fixed mesh)
    total_steps: int | None = None  # for the progress line (MeshConfig.total_steps)


def _prepare(w: WorkerSetup) -> tuple[priority.NicenessResult | None, dict[str, str]]:
    """Niceness (first, so the process group's threads inherit it) and the environment;
    returns the niceness result and the environment in force. Twice is harmless (the trials
    of ``mesh="auto"`` run before the mesh's own set-up)."""
    niced = priority.set_niceness(w.niceness) if w.niceness is not None else None
    os.environ.update(w.fixed_env)
    os.environ.update(RANK=str(w.rank), WORLD_SIZE=str(w.world_size),
                      LOCAL_RANK=str(w.local_rank), LOCAL_WORLD_SIZE=str(w.local_world_size),
                      NODE_RANK=str(w.node_rank))
    applied = apply_env(w.collective_env)
    return niced, applied


def trial_on_worker(w: WorkerSetup, layouts: list[Layout], step: StepFactory,
                    config: dict, steps: int, budget_s: float) -> list[dict[str, Any]]:
    """``mesh="auto"`` with ``plan.step``: join the world process group (kept for the mesh
    built next) and time the job's step on each candidate (``ray_mesh.planning.trial``)."""
    _prepare(w)
    dev, _ = bootstrap.join_world(w.backend, w.local_rank, w.device, w.rank, w.world_size,
                                  w.timeout_s)
    trials = run_trials(layouts, step, config, steps=steps, budget_s=budget_s,
                        device_type=dev.type, log=_log_line if w.rank == 0 else None)
    return [t.to_json() for t in trials]


def _log_line(line: str) -> None:
    logger.info("%s", line)  # once on the driver's console (see setup_on_worker)


def setup_on_worker(w: WorkerSetup) -> priority.NicenessResult | None:
    niced, applied = _prepare(w)
    in_force = {**w.fixed_env, **applied}
    line = rank_env_line(w.rank, w.node_rank, w.choice, in_force,
                         user_kept(w.collective_env, applied))
    # Logging, not print: Ray Train shows a worker's INFO line once on the driver's console
    # (a print would show twice). Only rank 0 speaks unless MeshConfig(verbose=True).
    logger.log(logging.INFO if w.verbose else logging.DEBUG, "%s", line)
    if not w.verbose:
        quiet_report_lines()  # Ray Train's INFO line per report (not under its log level)
    bootstrap.setup_worker(w.spec, rank=w.rank, world_size=w.world_size,
                           local_rank=w.local_rank, backend=w.backend, device=w.device,
                           timeout_s=w.timeout_s, env=in_force, layout=w.layout,
                           picked=w.picked)
    Observability(ObservabilitySettings(
        hang_timeout_s=w.hang_timeout_s, pg_timeout_s=w.timeout_s,
        wait_sample_s=w.wait_sample_s, links=w.links if w.rank == 0 else None,
        total_steps=w.total_steps)).start(bootstrap.get_mesh(), rank=w.rank,
                                          device=bootstrap.get_state().device)
    if w.rank == 0:
        logger.info("%s", w.layout_table)
    return niced


def shutdown_on_worker() -> None:
    owner = active.current()
    if owner is not None:  # None after a bring-up that failed before it
        owner.stop()
    bootstrap.shutdown_mesh()
