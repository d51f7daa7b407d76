"""MeshConfig and its Backend: the thin Ray Train glue around the Ray-free core.

``on_start`` (run by Ray Train's controller once the worker actors exist):
probe every worker -> plan the mesh on the real topology -> choose each node's interface
and rank 0's address -> set the environment and bootstrap every worker, all bounded in
time. Any failure shuts the worker group down before re-raising, because Ray Train leaks
the placement group and actors of a group whose backend hook raised, and the next
``fit()`` from the same driver then waits forever for resources
(upstream: ray-train-failed-start-leaks-group).
"""

from __future__ import annotations

import logging
import socket
import traceback
from contextlib import ExitStack
from dataclasses import InitVar, dataclass, replace
from typing import Any

import ray
from ray.train.backend import Backend
from ray.train.torch import TorchConfig

import ray_mesh.private_apis as private_apis
from ray_mesh.core import bootstrap, priority
from ray_mesh.core.diloco_config import too_few_replicas
from ray_mesh.core.layout import Layout, parse_layout, parse_replicate
from ray_mesh.core.options import OPTION_DEFAULTS, OPTION_NAMES, MeshOptions
from ray_mesh.core.spec import MeshSpec
from ray_mesh.core.topology import MeshPlan, TopologyError, WorkerReport, plan_mesh
from ray_mesh.core.values import describe
from ray_mesh.network.interfaces import (
    Choice,
    NetworkError,
    check_user_ifnames,
    choose_all,
    collective_env,
    free_port,
    local_interfaces,
    user_ifname_env,
)
from ray_mesh.network.probe import node_versions
from ray_mesh.observability import active
from ray_mesh.observability.layout import layout_table, node_lines
from ray_mesh.planning.inputs import PlanInputs
from ray_mesh.raytrain.bounded import BringUpError, wait_bounded
from ray_mesh.raytrain.data import install_mesh_data_config
from ray_mesh.raytrain.layout_io import save_layout
from ray_mesh.raytrain.links import (
    Pick,
    measure_worker_group,
    node_leaders,
    pick_mesh,
    rank_for_cluster,
)
from ray_mesh.raytrain.preflight import check_worker_group
from ray_mesh.raytrain.trials import trial_pick
from ray_mesh.raytrain.worker_setup import (
    Placement,
    WorkerSetup,
    setup_on_worker,
    shutdown_on_worker,
)

logger = logging.getLogger(__name__)


@dataclass
class MeshConfig(MeshOptions, TorchConfig):
    """``TorchConfig`` that builds a named DeviceMesh on every worker.

    The options below are :class:`ray_mesh.core.options.MeshOptions` (Ray-free, where their
    defaults and checks live); ``backend``, ``init_method`` and ``timeout_s`` are Ray's
    ``TorchConfig``'s, and keep their positions first: ``backend=None`` picks nccl on GPU
    workers and gloo on CPU workers; ``timeout_s`` is the torch.distributed collective timeout.
    (They are Ray's fields, so they are described here rather than under Args, which lists
    this class's own.)

    Args:
        mesh: a :class:`MeshSpec`, a dict of dim sizes, or ``'hsdp'``/``'fsdp'``/``'ddp'``;
            a :class:`MeshSpec` after construction.
        interface: ``'auto'`` (the interface carrying each node's Ray IP, else a Tailscale
            one) or an interface name present on every node.
        allow_cross_node_inner: accept tp*cp groups that cross nodes (slow; off by default).
        bringup_timeout_s: bound on the whole bring-up (process group and mesh); past it the
            run fails with the ranks that did not finish, instead of hanging.
        preflight: run the bounded network pre-flight (``ray_mesh.raytrain.preflight``)
            before the first process group.
        preflight_timeout_s: bound on the whole pre-flight.
        nccl_vpn_defaults: ``'auto'`` adds ``network.NCCL_VPN_DEFAULTS`` (sockets only) when
            the chosen interface is a VPN tunnel; True/False force it. A value the user set
            (runtime_env or the node's environment) always wins.
        worker_niceness: CPU niceness of the training workers' every thread. Ray starts
            workers at 15 (``RAY_worker_niceness``); torchrun ranks run at 0, and so do
            ray_mesh's by default (see ``ray_mesh.core.priority``). ``None`` keeps Ray's.
        measure_links: measure the node links at bring-up (``ray_mesh.raytrain.links``):
            ``'auto'`` when there are several nodes, reusing a measurement of the same nodes
            under 10 minutes old; True always measures afresh; False never.
        link_probe_s: bound on each link transfer (seconds); a round of pairs takes at most
            this long, a fast link much less.
        plan: what ``mesh='auto'`` plans with: a :class:`ray_mesh.PlanInputs` (the YAML
            ``plan:`` section). With ``mesh='auto'`` the backend picks the layout
            with the lowest predicted step time on the measured links and logs why.
        hang_timeout_s: a collective on a mesh dim's group (or the world group) that does not
            complete within this many seconds is a hang: the run ends with a report naming
            the dim, the collective, the ranks that did not arrive and their Python stacks
            (``ray_mesh.observability.hang``; the groups' process-group timeout becomes
            ``hang_timeout_s + 15``). ``None`` turns the watch off.
        wait_sample_s: interval of the per-dim wait sampler (``observability.waits``); None: off.
        verbose: every rank logs its environment line (interface, MASTER_*, NCCL_/GLOO_*);
            by default rank 0 logs the layout and one interface line per node.
        replicate: how replicas keep together over ``dp_replicate``: None / ``'sync'`` (HSDP,
            the default), or a ``DiLoCoConfig`` / mapping like ``{'mode': 'diloco', 'every':
            50, 'compress': 'int8'}`` (the YAML ``replicate:`` section). With the mesh it makes
            the run's :class:`~ray_mesh.core.layout.Layout` (:attr:`layout`), which every
            worker's mesh carries: ``ray_mesh.parallel.replicate_config()`` reads it there,
            ``wrap_replicate(model)`` builds the outer loop (``ray_mesh.parallel.replicate``).
        layout: the whole layout at once instead of ``mesh``/``replicate``: a
            :class:`~ray_mesh.core.layout.Layout`, its string
            (``'dp_replicate=nodes,dp_shard=-1/bf16/sync'``) or mapping (a job's ``layout:``);
            its reduce dtype is what ``parallelize`` reduces gradients in. After construction
            this field holds the run's Layout (None with ``mesh='auto'``, which picks it).
        total_steps: the run's number of steps, for the progress line's ``step i/N`` and
            its ETA (``ray-mesh run`` passes the job's ``config.steps``); None: unknown.
        options: every option above at once, as a
            :class:`~ray_mesh.core.options.MeshOptions` (its ``mesh`` left None: the mesh
            is ``mesh=``'s or ``layout=``'s), instead of one by one;
            ``MeshConfig(layout=..., options=...)`` is a run's settings in two objects.
            Read at construction only (the fields above then hold the values), so
            ``dataclasses.replace`` works on the result as on any config.

    Inside the train function, ``ray_mesh.report`` (``ray.train.report`` with ray_mesh's
    bookkeeping) feeds ray_mesh's metrics and console (see ``ray_mesh.observability.report``):
    every number reported becomes a mesh-tagged metric, and world rank 0 shows a progress
    line per report. A plain ``ray.train.report`` reaches Ray Train alone.

    Stability: stable
    """

    plan: PlanInputs | None = None
    replicate: Any = None
    layout: Any = None
    total_steps: int | None = None
    options: InitVar[MeshOptions | None] = None

    def __post_init__(self, options: MeshOptions | None = None) -> None:
        # Parse here so bad input fails on the driver, before any worker starts.
        if options is not None:
            self._take_options(options)
        given = None
        if self.layout is not None:
            given = parse_layout(self.layout)
            if not self._agrees(given):
                raise ValueError("give MeshConfig(layout=...) or mesh=/replicate=, not both: "
                                 f"the layout {given} already says the mesh and replicate mode")
            self.mesh, self.replicate = given.mesh, given.diloco
        if self.mesh == "auto":
            if not isinstance(self.plan, PlanInputs):
                raise ValueError("mesh='auto' needs plan=PlanInputs(...) (the model's size, "
                                 "tokens per step and compute time; in YAML the plan: "
                                 "section) to predict each layout's step time")
        else:
            self.mesh = MeshSpec.from_dict(self.mesh)
        self.check_options()
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be None (nccl on GPU workers, gloo on CPU), 'nccl' "
                             f"or 'gloo', got {self.backend!r}.")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float)
                or not 0 < self.timeout_s < float("inf")):
            raise ValueError(f"timeout_s (the collective timeout) must be a finite number of "
                             f"seconds > 0, got {self.timeout_s!r}.")
        self.replicate = parse_replicate(self.replicate)
        if self.total_steps is not None and (isinstance(self.total_steps, bool) or not
                                             isinstance(self.total_steps, int)
                                             or self.total_steps < 1):
            raise ValueError(f"total_steps must be a whole number of steps >= 1 (or None when "
                             f"unknown), got {self.total_steps!r}.")
        self.layout = None if self.mesh == "auto" else replace(
            given or Layout(), mesh=self.mesh, diloco=self.replicate)
        if self.init_method != "env":
            raise ValueError("MeshConfig sets MASTER_ADDR/MASTER_PORT itself: use "
                             f"init_method='env' (got {self.init_method!r}).")

    def _take_options(self, options: MeshOptions) -> None:
        """Set every option from ``options``; refuse a mesh in it, or options also given
        one by one (which of the two would win is not something to guess)."""
        if not isinstance(options, MeshOptions):
            raise ValueError(f"options must be a ray_mesh.MeshOptions (e.g. MeshOptions("
                             f"interface='tailscale0')), got {describe(options)}.")
        if options.mesh is not None:
            raise ValueError("options.mesh is set: the mesh is MeshConfig's own (mesh=... or "
                             "layout=...); build the MeshOptions without it.")
        twice = [n for n in OPTION_NAMES if getattr(self, n) != OPTION_DEFAULTS[n]]
        if twice:
            raise ValueError(f"give the options in options=MeshOptions(...) or one by one, "
                             f"not both: {', '.join(twice)} given beside options= (move "
                             f"{'it' if len(twice) == 1 else 'them'} into the MeshOptions).")
        for name, value in options.option_values().items():
            setattr(self, name, value)

    def _agrees(self, layout: Layout) -> bool:
        """Whether ``mesh``/``replicate`` are unset or already this layout's (a config made
        by ``dataclasses.replace`` of a built one carries both)."""
        if self.mesh is None and self.replicate is None:
            return True
        try:
            return (MeshSpec.from_dict(self.mesh) == layout.mesh
                    and parse_replicate(self.replicate) == layout.diloco)
        except (ValueError, TypeError):
            return False

    @property
    def backend_cls(self):
        return _MeshBackend

    @property
    def train_func_context(self):
        # Ray Train (V2) reads this on the driver when fit() starts
        # (DataParallelTrainer._get_train_func), before the controller exists: the one
        # driver-side moment a BackendConfig gets. Run-state tracking is decided there
        # (upstream: ray-train-no-driver-hook).
        _on_driver_at_fit(self.interface)
        return _TrainThreadContext

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out.update(self.options_dict())
        out["replicate"] = None if self.replicate is None else vars(self.replicate)
        out["layout"] = "auto" if self.layout is None else str(self.layout)
        out["total_steps"] = self.total_steps
        return out


def _on_driver_at_fit(interface: str) -> None:
    """Driver-side set-up a ``MeshConfig`` run gets without extra calls (see driver.py)."""
    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is not None:
        return  # not a connected driver (Ray not started yet, or inside an actor)
    from ray_mesh.raytrain.driver import enable_state_tracking, warm_controller_actors

    enable_state_tracking()
    warm_controller_actors(interface)


class _TrainThreadContext:
    """Entered by Ray Train in the training thread: make the mesh's device current there,
    give threads started since bring-up the workers' niceness, enter the worker's
    observability for the train function (``Observability.train_thread``: the wait sampler
    watches this thread, the recorder saves the run's summary at its end), and turn an error of a
    collective the hang watch reported on into a ``CollectiveHangError`` carrying the report.

    A train function that raised leaves its locals (the FSDP model, the optimizer) held by
    the error's traceback, which Ray Train keeps to report: the mesh's groups could then not
    be freed at shutdown (each worker warned, with advice the user cannot follow, and the
    groups' threads lived to interpreter exit, where gloo can abort the process). The frames
    of the ended function are cleared on the way out: the traceback Ray Train prints (file,
    line, function, source) is unchanged, the locals it never sends are dropped."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._owner = None

    def __enter__(self) -> None:
        priority.reapply()
        if bootstrap.is_initialized():
            bootstrap.use_device(bootstrap.get_state().device)
        self._owner = active.current()
        if self._owner is not None:
            self._stack.enter_context(self._owner.train_thread())

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stack.close()
        better = self._owner.explain(exc) if self._owner is not None else None
        _drop_locals(exc)
        if better is not None:  # Ray Train shows 1000 characters: the report, not gloo's text
            raise better from None
        return False


def _drop_locals(exc: BaseException | None) -> None:
    """Clear the ended frames of ``exc``'s tracebacks, its causes and contexts included
    (``traceback.clear_frames`` leaves a frame that is still running as it is)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


# ----------------------------------------------------------------------------- on workers
def _probe_worker() -> WorkerReport:
    ctx = ray.train.get_context()
    return WorkerReport(
        rank=ctx.get_world_rank(),
        node_id=ray.get_runtime_context().get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
        hostname=socket.gethostname(),
        local_rank=ctx.get_local_rank(),
        device=str(ray.train.torch.get_device()),
        interfaces=local_interfaces(),
        versions=node_versions(),
    )


# ----------------------------------------------------------------------------- controller
def _release_worker_group(worker_group) -> None:
    """Shut down a V2 worker group whose start failed (see the module docstring)."""
    v2_group = private_apis.v2_worker_group_type()
    if v2_group is None:  # Ray Train V1: its own cleanup handles a failed start
        return
    if isinstance(worker_group, v2_group):
        try:
            worker_group.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the original error is what matters
            logger.warning("ray_mesh: could not shut down the failed worker group",
                           exc_info=True)


def plan_for(worker_group, config: MeshConfig
             ) -> tuple[MeshPlan, list[Choice], list[WorkerReport]]:
    """Probe the workers and plan the mesh and interfaces; raises before any process group.

    With ``mesh='auto'`` the plan is provisional (flat FSDP) until the links are measured.
    """
    reports = worker_group.execute(_probe_worker)
    spec = MeshSpec.fsdp() if config.mesh == "auto" else config.mesh
    plan = plan_mesh(spec, reports, allow_cross_node_inner=config.allow_cross_node_inner)
    if config.layout is not None:
        check_resolved(config.layout, plan)
    gpus = worker_group.get_resources_per_worker().get("GPU", 0)
    if gpus and any(not r.device.startswith("cuda") for r in reports):
        cpu_ranks = [r.rank for r in reports if not r.device.startswith("cuda")]
        raise BringUpError(
            f"GPUs were asked for, but ranks {cpu_ranks} see no CUDA device (torch "
            f"{reports[0].versions.get('torch')}). Install a CUDA build of torch on those nodes, "
            f"or run with ScalingConfig(use_gpu=False)."
        )
    choices = choose_all(plan.workers, config.interface)
    nccl = "nccl" in (config.backend or ("nccl" if gpus else "gloo"))  # user's *_IFNAME wins
    check_user_ifnames(reports, worker_group.execute(user_ifname_env), nccl=nccl)
    return plan, choices, reports


def check_resolved(layout: Layout, plan: MeshPlan) -> None:
    """The layout's rule (``too_few_replicas``) on its dims as sized for this cluster:
    DiLoCo with ``dp_replicate: nodes`` on one node has one replica. Refused here, before
    any process group, naming what the dims came to, instead of by ``wrap_replicate`` on
    every worker."""
    if too_few_replicas(layout.diloco, plan.spec.dp_replicate) is not None:
        sized = Layout(plan.spec).dims_text
        raise TopologyError(
            f"replicate.mode=diloco averages 2 or more replicas over dp_replicate, but the "
            f"mesh {layout.dims_text} comes to {sized} on this cluster ({plan.num_nodes} "
            f"node(s), {len(plan.workers)} worker(s)): run on 2 or more nodes, set "
            f"mesh.dp_replicate: 2 (two replicas on one node), or use replicate.mode: sync.")


def _warn_niceness(plan: MeshPlan, results: list, target: int | None) -> None:
    """One warning naming the nodes whose workers kept Ray's niceness, and the fix."""
    failed = {plan.workers[i].node_ip: r for i, r in enumerate(results)
              if r is not None and r.error}
    if not failed:
        return
    first = next(iter(failed.values()))
    logger.warning(
        "ray_mesh: training workers on %s still run at niceness %d, not %d: %s. At that "
        "niceness they lose CPU to every nice-0 process on the node. Start Ray with "
        "RAY_worker_niceness=%d in the environment of `ray start` on those nodes (the "
        "deploy/tailscale scripts do), or pass MeshConfig(worker_niceness=None) to keep "
        "Ray's setting and silence this.",
        ", ".join(sorted(failed)), first.after, target, first.error, target)


def _setups(plan: MeshPlan, choices: list[Choice], config: MeshConfig, fixed: dict[str, str],
            table: str, pick: Pick | None, links: list | None = None) -> list[WorkerSetup]:
    """What each worker is told at bring-up, in rank order. The layout table and the links
    go to rank 0 only, which alone logs and exports them (each is O(ranks) or O(nodes²):
    sent to every rank, the bring-up carried ranks² rows of table)."""
    layout = replace(pick.layout if pick else config.layout or Layout(), mesh=plan.spec)
    options = config.worker_options()
    return [WorkerSetup(
        placement=Placement(
            rank=w.rank, world_size=len(plan.workers), local_rank=w.local_rank,
            local_world_size=plan.workers_per_node, node_rank=plan.node_rank(w.rank),
            device=w.device, choice=choices[w.rank], fixed_env=fixed,
            collective_env=collective_env(choices[w.rank], config.nccl_vpn_defaults)),
        layout=layout, options=options, backend=config.backend,
        timeout_s=float(config.timeout_s), total_steps=config.total_steps,
        layout_table=table if w.rank == 0 else "", links=links if w.rank == 0 else None,
        picked=pick.why if pick else "") for w in plan.workers]


class _MeshBackend(Backend):
    share_cuda_visible_devices: bool = True
    trials: list | None = None  # mesh="auto"'s trials (ray_mesh.planning.trial.Trial), if run
    # How long on_shutdown waits for the workers to tear their process groups down. After a
    # failed on_start a worker may still be stuck in what it was given (a stalled trial step,
    # a collective its peer left): Ray Train kills the actors right after on_shutdown, so a
    # long wait there only delays the error the user is waiting for.
    shutdown_wait_s: float = 30.0

    def on_start(self, worker_group, backend_config: MeshConfig) -> None:
        try:
            self._start(worker_group, backend_config)
        except BaseException as exc:
            self.shutdown_wait_s = 3.0
            _release_worker_group(worker_group)
            ours = (NetworkError, BringUpError, TopologyError)  # bad input: shown as one line
            if isinstance(exc, ours):
                private_apis.quiet_callback_traceback(ours)
            raise

    def _start(self, worker_group, config: MeshConfig) -> None:
        """The bring-up, step by step; each step raises before any process group exists,
        except the last, which builds them."""
        plan, choices, reports = plan_for(worker_group, config)  # probe, plan, interfaces
        if config.mesh != "auto":
            # Datasets split by dp rank, peers read the same batches (or a clear error, early).
            install_mesh_data_config(worker_group, plan.spec)
        fixed = self._rendezvous(worker_group, plan, choices, config)  # MASTER_*, pre-flight
        leaders = node_leaders([plan.node_rank(w.rank) for w in plan.workers])
        self.links = measure_worker_group(worker_group, leaders, choices,
                                          config.measure_links, config.link_probe_s)
        pick = None
        if config.mesh == "auto":  # the layout for these links (and the job's step timed)
            pick, plan = self._pick(worker_group, plan, choices, reports, config, fixed,
                                    len(leaders))
        self._bring_up(worker_group, plan, choices, config, fixed, pick)

    @staticmethod
    def _rendezvous(worker_group, plan: MeshPlan, choices: list[Choice],
                    config: MeshConfig) -> dict[str, str]:
        """Rank 0's address and a free port there, and the pre-flight of every pair of nodes
        on it: the environment every worker's process group starts from."""
        master = choices[0]
        port = worker_group.execute_single(0, free_port, master.address)
        if config.preflight:
            check_worker_group(worker_group, plan, choices, port, config.preflight_timeout_s)
        return {"MASTER_ADDR": master.address, "MASTER_PORT": str(port)}

    def _pick(self, worker_group, plan: MeshPlan, choices: list[Choice],
              reports: list[WorkerReport], config: MeshConfig, fixed: dict[str, str],
              nodes: int) -> tuple[Pick, MeshPlan]:
        """``mesh='auto'``: the layout predicted best for the measured links, or, with a
        step to time, the best of the candidates timed on every worker; the plan for it."""
        gpu = any(r.device.startswith("cuda") for r in reports)
        args = (config.plan, nodes, plan.workers_per_node, self.links,
                config.backend or ("nccl" if gpu else "gloo"), config.replicate)
        if config.plan.step is None:  # by prediction alone
            pick = pick_mesh(*args)
        else:  # the job's step timed on every candidate, the world group kept
            ranked = rank_for_cluster(*args)
            pick, self.trials = trial_pick(
                worker_group, _setups(plan, choices, config, fixed, "", None),
                ranked, config.plan, config.bringup_timeout_s)
        plan = plan_mesh(pick.layout.mesh, reports,
                         allow_cross_node_inner=config.allow_cross_node_inner)
        install_mesh_data_config(worker_group, plan.spec)
        return pick, plan

    def _bring_up(self, worker_group, plan: MeshPlan, choices: list[Choice],
                  config: MeshConfig, fixed: dict[str, str], pick: Pick | None) -> None:
        """Every worker builds its process groups and mesh (bounded), the layout table is
        printed once, the niceness checked, and the layout saved for ``ray-mesh status``."""
        interfaces = {i: c.interface for i, c in enumerate(choices)}
        layout = replace(pick.layout if pick else config.layout, mesh=plan.spec)
        table = layout_table(plan, interfaces, layout) + "\n" + node_lines(plan, choices)
        refs = [worker_group.execute_single_async(w.rank, setup_on_worker, setup)
                for w, setup in zip(plan.workers, _setups(
                    plan, choices, config, fixed, table, pick,
                    self.links and self.links.exported().to_json()), strict=True)]
        labels = [f"rank {w.rank} ({w.node_ip}, {interfaces[w.rank]})" for w in plan.workers]
        niced = wait_bounded(refs, config.bringup_timeout_s, "Mesh bring-up", labels)
        _warn_niceness(plan, niced, config.worker_niceness)
        save_layout(worker_group, plan, interfaces, layout)

    def on_shutdown(self, worker_group, backend_config: MeshConfig) -> None:
        # Also runs after a half-finished on_start: shutdown_mesh tolerates "nothing built".
        try:
            wait_bounded(worker_group.execute_async(shutdown_on_worker), self.shutdown_wait_s,
                         "Process group shutdown", [str(i) for i in range(len(worker_group))])
        except ray.exceptions.RayActorError as exc:
            # A worker whose process or node is gone (a killed box, a failed attempt): there
            # is nothing of it to shut down, and Ray Train has already said why it ended.
            logger.debug("ray_mesh: process group shutdown skipped a gone worker: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a dead worker must not block the shutdown
            logger.warning("ray_mesh: process group shutdown incomplete: %s", exc)


__all__ = ["MeshConfig"]
