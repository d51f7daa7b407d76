"""YAML job files -> typed job sections, with every input checked on the driver, Ray-free.

A job file::

    name: hsdp                          # run name (RunConfig.name)
    train: examples/hsdp.py:train_loop  # file path or package.module, then :function
    config: {steps: 40}                 # train_loop_config
    mesh: {dp_replicate: 2, dp_shard: -1}   # or: hsdp | fsdp | ddp
    scaling: {num_workers: 4, use_gpu: auto, resources_per_worker: {CPU: 1}}
    network: {interface: auto, bringup_timeout_s: 120, worker_niceness: 0, hang_timeout_s: 60}
    run: {storage_path: ./ray_results, max_failures: 0, num_to_keep: 3}
    data: {paths: [stdlib], seq_len: 128, batch_size: 16}   # see ray_mesh.data.spec
    replicate: {mode: diloco, every: 50, compress: int8}  # default mode: sync (HSDP)
    # run.min_workers: N makes the run elastic (num_workers is then the maximum);
    # run.startup_retries bounds the restarts of a group that cannot start (default 3).

Each section is a frozen dataclass: ``mesh`` a :class:`~ray_mesh.core.spec.MeshSpec`,
``scaling`` a :class:`ScalingSection`, ``network`` a :class:`NetworkSection` (every
``MeshConfig`` option; its defaults are read from :class:`~ray_mesh.core.options.MeshOptions`,
the fields ``MeshConfig`` inherits, so the two cannot drift), ``run`` a :class:`RunSection`.
Relative paths in ``train`` resolve against the job file's folder, then the working dir.
Nothing here imports Ray (``ray.cloudpickle`` only when a train file is loaded).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ray_mesh.checkpointing.names import run_name_problem
from ray_mesh.core.options import OPTION_DEFAULTS, check_option_values
from ray_mesh.core.spec import MeshSpec, MeshSpecError, load_yaml
from ray_mesh.parallel.errors import ParallelError
from ray_mesh.parallel.replicate import check_mesh as check_replicate_mesh
from ray_mesh.parallel.replicate import parse_replicate
from ray_mesh.raytrain.elastic import STARTUP_RETRIES


class JobError(ValueError):
    """A job file that cannot run; the message names the key and the fix."""


def _mesh_and_plan(top: dict, base_dir: Path, config: dict) -> tuple[MeshSpec | str, Any]:
    """``mesh:`` and ``plan:``: ``mesh: auto`` needs a plan (the planner's inputs); a plan
    with a fixed mesh is still checked, for ``ray-mesh plan JOB.yaml``."""
    from ray_mesh.planning.cost import PlanError
    from ray_mesh.planning.inputs import PlanInputs

    plan = None
    if "plan" in top:
        try:
            plan = PlanInputs.from_dict(top["plan"], lambda ref: load_function(ref, base_dir),
                                        config)
        except PlanError as exc:
            raise JobError(str(exc)) from exc
    if top.get("mesh") == "auto":
        if plan is None:
            raise JobError("mesh: auto needs a plan: section (model, tokens_per_step, "
                           "compute_s) so the planner can predict each layout's step time; or "
                           "give the mesh, e.g. mesh: hsdp")
        return "auto", plan
    try:
        return MeshSpec.from_dict(top.get("mesh")), plan
    except MeshSpecError as exc:
        raise JobError(f"mesh: {exc}") from exc


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ScalingSection:
    """``scaling:`` how many workers, and what each holds (Ray Train's ScalingConfig)."""

    num_workers: int = 4
    use_gpu: bool | str = "auto"  # 'auto': GPUs when the cluster has one per worker
    resources_per_worker: Mapping[str, float] | None = None
    placement_strategy: str | None = None  # None: ScalingConfig's own default (PACK)

    def __post_init__(self) -> None:
        workers = self.num_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise JobError(f"scaling.num_workers must be a positive int, got {workers!r}.")
        if self.use_gpu not in (True, False, "auto"):
            raise JobError(f"scaling.use_gpu must be true, false or auto, got "
                           f"{self.use_gpu!r}.")
        res = self.resources_per_worker
        if res is not None and (not isinstance(res, Mapping) or any(
                not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float)
                or v < 0 for k, v in res.items())):
            raise JobError(f"scaling.resources_per_worker must map resource names to amounts "
                           f">= 0, e.g. {{CPU: 1, GPU: 1}}; got {res!r}.")
        if self.placement_strategy is not None and \
                self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise JobError(f"scaling.placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                           f"got {self.placement_strategy!r}.")


@dataclass(frozen=True)
class NetworkSection:
    """``network:`` the ``MeshConfig`` options (bring-up, interfaces, process group, priority).

    ``backend`` and ``timeout_s`` left unset keep ``TorchConfig``'s defaults (nccl on GPUs
    else gloo; 1800 s).
    """

    interface: str = OPTION_DEFAULTS["interface"]
    bringup_timeout_s: float = OPTION_DEFAULTS["bringup_timeout_s"]
    allow_cross_node_inner: bool = OPTION_DEFAULTS["allow_cross_node_inner"]
    backend: str | None = None
    timeout_s: int | None = None
    preflight: bool = OPTION_DEFAULTS["preflight"]
    preflight_timeout_s: float = OPTION_DEFAULTS["preflight_timeout_s"]
    nccl_vpn_defaults: bool | str = OPTION_DEFAULTS["nccl_vpn_defaults"]
    worker_niceness: int | None = OPTION_DEFAULTS["worker_niceness"]
    hang_timeout_s: float | None = OPTION_DEFAULTS["hang_timeout_s"]
    wait_sample_s: float | None = OPTION_DEFAULTS["wait_sample_s"]
    measure_links: bool | str = OPTION_DEFAULTS["measure_links"]
    link_probe_s: float = OPTION_DEFAULTS["link_probe_s"]

    def __post_init__(self) -> None:
        try:
            check_option_values({k: v for k, v in self.mesh_config_kwargs().items()
                                 if k in OPTION_DEFAULTS})
        except ValueError as exc:
            raise JobError(f"network.{exc}") from exc
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise JobError(f"network.backend must be a torch.distributed backend name (gloo, "
                           f"nccl) or left out, got {self.backend!r}.")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            raise JobError(f"network.timeout_s must be a positive int (seconds), got {t!r}.")

    def mesh_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``MeshConfig`` (unset TorchConfig values left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items()
                if v is not None or k not in ("backend", "timeout_s")}


@dataclass(frozen=True)
class RunSection:
    """``run:`` where results go, failure handling, elasticity (Ray Train's RunConfig)."""

    storage_path: str | None = None
    max_failures: int = 0
    num_to_keep: int | None = None
    min_workers: int | None = None  # set: an elastic run of min_workers..num_workers
    startup_retries: int = STARTUP_RETRIES

    def __post_init__(self) -> None:
        for key, low in (("max_failures", -1), ("num_to_keep", 1), ("min_workers", 1),
                         ("startup_retries", -1)):
            value = getattr(self, key)
            if value is None and key in ("num_to_keep", "min_workers"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise JobError(f"run.{key} must be an int >= {low}, got {value!r}.")
        if self.storage_path is not None and not isinstance(self.storage_path, str):
            raise JobError(f"run.storage_path must be a path or URI string, got "
                           f"{self.storage_path!r}.")


def _keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


TOP_KEYS = ("name", "train", "config", "mesh", "scaling", "network", "run", "data", "replicate",
            "plan")
SCALING_KEYS = _keys(ScalingSection)
NETWORK_KEYS = _keys(NetworkSection)
RUN_KEYS = _keys(RunSection)


def _check_keys(section: str, data: Any, allowed: tuple[str, ...]) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobError(f"'{section}' must be a mapping, got {type(data).__name__}: {data!r}.")
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise JobError(f"Unknown key {key!r} in '{section}'.{hint} Allowed: {allowed}.")
    return dict(data)


@dataclass(frozen=True)
class Job:
    """A parsed job file. Frozen: the runner derives what it needs instead of editing it."""

    name: str
    train: str
    config: dict = field(default_factory=dict)
    mesh: MeshSpec | str = field(default_factory=MeshSpec)  # "auto": planned at bring-up
    scaling: ScalingSection = field(default_factory=ScalingSection)
    network: NetworkSection = field(default_factory=NetworkSection)
    run: RunSection = field(default_factory=RunSection)
    replicate: Any = None  # a DiLoCoConfig (replicate: {mode: diloco, ...}) or None (sync)
    plan: Any = None  # a ray_mesh.planning.inputs.PlanInputs (the plan: section), or None
    base_dir: Path = field(default_factory=Path.cwd)
    data: Any = None
    """The checked ``data:`` section (a ray_mesh.data.spec.DataSpec), or None."""

    def __post_init__(self) -> None:
        if self.run.min_workers is not None and self.run.min_workers > self.scaling.num_workers:
            raise JobError(f"run.min_workers={self.run.min_workers} is above "
                           f"scaling.num_workers={self.scaling.num_workers} (the maximum of an "
                           f"elastic run). Lower it.")

    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | None = None) -> Job:
        top = _check_keys("job", data, TOP_KEYS)
        if "train" not in top:
            raise JobError("The job has no 'train' key: name the train function as "
                           "'path/to/file.py:function' or 'package.module:function'.")
        config = top.get("config") or {}
        if not isinstance(config, dict):
            raise JobError(f"'config' must be a mapping, got {config!r}.")
        mesh, plan = _mesh_and_plan(top, base_dir or Path.cwd(), config)
        name = top.get("name") or Path(str(top["train"]).split(":")[0]).stem
        if isinstance(name, int) and not isinstance(name, bool):
            name = str(name)  # `name: 2024` in YAML
        why = run_name_problem(name)
        if why:
            raise JobError(f"name: {name!r} cannot be a run name: {why}. The run directory is "
                           f"<storage_path>/<name>: use one plain path component such as "
                           f"'hsdp_run1'; to write elsewhere, set run.storage_path.")
        scaling = ScalingSection(**_check_keys("scaling", top.get("scaling"), SCALING_KEYS))
        from ray_mesh.data.spec import DataSpecError, parse_job_data

        try:  # files, split, batch vs dp, seq_len vs the model: all before any worker
            data_spec = parse_job_data(top.get("data"), base_dir or Path.cwd(),
                                       mesh=None if mesh == "auto" else mesh,
                                       num_workers=scaling.num_workers, config=config)
        except DataSpecError as exc:
            raise JobError(str(exc)) from exc
        try:
            replicate = parse_replicate(top.get("replicate"))
            if mesh != "auto":
                check_replicate_mesh(replicate, mesh.dp_replicate)
        except ParallelError as exc:
            raise JobError(str(exc)) from exc
        return cls(
            replicate=replicate,
            name=name,
            train=str(top["train"]),
            config=config,
            mesh=mesh,
            scaling=scaling,
            network=NetworkSection(**_check_keys("network", top.get("network"), NETWORK_KEYS)),
            run=RunSection(**_check_keys("run", top.get("run"), RUN_KEYS)),
            base_dir=base_dir or Path.cwd(),
            data=data_spec,
            plan=plan,
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> Job:
        path = Path(path)
        return cls.from_dict(load_yaml(path, error=JobError), base_dir=path.resolve().parent)

    def with_num_workers(self, num_workers: int) -> Job:
        """This job on ``num_workers`` workers (``ray-mesh run --num-workers``), re-checked."""
        return replace(self, scaling=replace(self.scaling, num_workers=num_workers))

    # ------------------------------------------------------------------ train function
    def load_train_fn(self) -> Callable[..., Any]:
        return load_function(self.train, self.base_dir)


def load_function(ref: str, base_dir: Path | None = None) -> Callable[..., Any]:
    """Import ``path/to/file.py:fn`` or ``package.module:fn``, with an error naming the fix."""
    if ":" not in ref:
        raise JobError(f"train: {ref!r} must be 'path/to/file.py:function' or "
                       f"'package.module:function' (the ':function' part is missing).")
    target, fn_name = ref.rsplit(":", 1)
    if target.endswith(".py") or os.sep in target:
        candidates = [Path(target)] if Path(target).is_absolute() else [
            (base_dir or Path.cwd()) / target, Path.cwd() / target]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise JobError(f"train: file {target!r} not found (looked in "
                           f"{', '.join(str(p.parent) for p in candidates)}).")
        module_name = f"ray_mesh_job_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise JobError(f"train: importing {path} failed: {type(exc).__name__}: {exc}") \
                from exc
        _ship_by_value(module)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise JobError(f"train: cannot import module {target!r}: {type(exc).__name__}: "
                           f"{exc}. Is it installed, or on PYTHONPATH?") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        close = difflib.get_close_matches(fn_name, names, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise JobError(f"train: {target} has no function {fn_name!r}.{hint}")
    return fn


def _ship_by_value(module: Any) -> None:
    """Workers cannot import a module that only exists on the driver: pickle it by value.

    Ray's cloudpickle is imported here, not at module level, so that parsing a job file
    needs no Ray; without Ray installed there is no worker to ship to.
    """
    try:
        from ray import cloudpickle
    except ImportError:
        return
    cloudpickle.register_pickle_by_value(module)


__all__ = ["Job", "JobError", "NetworkSection", "RunSection", "ScalingSection", "load_function"]
