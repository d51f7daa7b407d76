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
    # replica_groups: {...} instead of mesh: runs replica groups (cli.job_groups); data:
    # then feeds them by sample index (ray_mesh.data.indexed)
    replicate: {mode: diloco, every: 50, compress: int8}  # default mode: sync (HSDP)
    # or, instead of mesh: and replicate:, the whole layout in one (ray_mesh.core.layout):
    # layout: dp_replicate=nodes,dp_shard=-1/bf16/sync
    # run.min_workers: N makes the run elastic (num_workers is then the maximum);
    # run.startup_retries bounds the restarts of a group that cannot start (default 3).

Each section is a frozen dataclass: ``mesh`` a :class:`~ray_mesh.core.spec.MeshSpec`,
``scaling`` a :class:`ScalingSection`, ``network`` a :class:`NetworkSection` (every
``MeshConfig`` option as one :class:`~ray_mesh.core.options.MeshOptions`, the type
``MeshConfig`` inherits, so the two cannot drift), ``run`` a :class:`RunSection`.
Relative paths in ``train`` resolve against the job file's folder, then the working dir.
Nothing here imports Ray (``ray.cloudpickle`` only when a train file is loaded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ray_mesh.checkpointing.names import run_name_problem
from ray_mesh.cli.job_checks import (
    JobError,
    check_backend,
    check_keys,
    check_mesh_fits,
    check_train_ref,
    load_function,
)
from ray_mesh.core.layout import Layout, parse_layout, parse_replicate
from ray_mesh.core.object_store import check_location
from ray_mesh.core.options import OPTION_NAMES, MeshOptions, check_option_values
from ray_mesh.core.spec import MeshSpec, MeshSpecError, load_yaml
from ray_mesh.core.values import MAX_SECONDS, brief, describe, read_bool, read_int, read_str
from ray_mesh.errors import LayoutError, ParallelError, StorageURIError
from ray_mesh.raytrain.elastic import STARTUP_RETRIES


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


def _layout_section(top: dict) -> Layout | None:
    """``layout:``, the whole layout in one (its string or mapping), or None; it replaces
    ``mesh:`` and ``replicate:``, so a job gives one or the other."""
    if "layout" not in top:
        return None
    both = [k for k in ("mesh", "replicate") if k in top]
    if both:
        raise JobError(f"layout: already says the mesh and the replicate mode; remove "
                       f"{' and '.join(both)}: (or remove layout: and keep them)")
    try:
        return parse_layout(top["layout"])
    except LayoutError as exc:
        raise JobError(f"layout: {exc}") from exc


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
MAX_WORKERS = 100_000
"""More workers than any Ray cluster runs: a larger scaling.num_workers is a typo."""


@dataclass(frozen=True)
class ScalingSection:
    """``scaling:`` how many workers, and what each holds (Ray Train's ScalingConfig)."""

    num_workers: int = 4
    use_gpu: bool | str = "auto"  # 'auto': GPUs when the cluster has one per worker
    resources_per_worker: Mapping[str, float] | None = None
    placement_strategy: str | None = None  # None: ScalingConfig's own default (PACK)

    def __post_init__(self) -> None:
        read_int("scaling.num_workers", self.num_workers, 1, MAX_WORKERS, example=4,
                 error=JobError)
        read_bool("scaling.use_gpu", self.use_gpu, also=("auto",), error=JobError)
        res = self.resources_per_worker
        if res is not None and (not isinstance(res, Mapping) or any(
                not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float)
                or not math.isfinite(v) or v < 0 for k, v in res.items())):
            raise JobError(f"scaling.resources_per_worker must map resource names to amounts "
                           f">= 0, e.g. {{CPU: 1, GPU: 1}}; got {brief(res)}.")
        read_str("scaling.placement_strategy", self.placement_strategy,
                 choices=PLACEMENT_STRATEGIES, none_ok=True, error=JobError)


@dataclass(frozen=True)
class NetworkSection:
    """``network:`` the ``MeshConfig`` options (bring-up, interfaces, process group,
    priority) as one :class:`~ray_mesh.core.options.MeshOptions`, where their defaults and
    checks live, plus Ray's ``backend`` and ``timeout_s``: left unset they keep
    ``TorchConfig``'s defaults (nccl on GPUs else gloo; 1800 s). Build it with
    :meth:`from_dict` (the job file's mapping)."""

    options: MeshOptions = field(default_factory=MeshOptions)
    backend: str | None = None
    timeout_s: int | None = None

    @classmethod
    def from_dict(cls, data: Any) -> NetworkSection:
        values = dict(check_keys("network", data, NETWORK_KEYS))
        backend, timeout_s = values.pop("backend", None), values.pop("timeout_s", None)
        try:
            check_option_values(values)
        except ValueError as exc:
            raise JobError(f"network.{exc}") from exc
        check_backend("network.backend", backend)
        read_int("network.timeout_s", timeout_s, 1, int(MAX_SECONDS), example=1800,
                 none_ok=True, error=JobError)
        return cls(MeshOptions(**values), backend, timeout_s)

    def mesh_config_kwargs(self, verbose: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``MeshConfig``: the section's options whole (``verbose``
        is the command line's; the mesh is the job's), and Ray's fields when set."""
        out: dict[str, Any] = {"options": replace(self.options, verbose=verbose)}
        out.update({k: v for k, v in (("backend", self.backend), ("timeout_s", self.timeout_s))
                    if v is not None})
        return out


@dataclass(frozen=True)
class RunSection:
    """``run:`` where results go, failure handling, elasticity (Ray Train's RunConfig)."""

    storage_path: str | None = None
    storage_endpoint: str | None = None  # an S3-compatible server's URL (MinIO, a lab's)
    max_failures: int = 0
    num_to_keep: int | None = None
    min_workers: int | None = None  # set: an elastic run of min_workers..num_workers
    startup_retries: int = STARTUP_RETRIES

    def __post_init__(self) -> None:
        for key, low in (("max_failures", -1), ("num_to_keep", 1), ("min_workers", 1),
                         ("startup_retries", -1)):
            read_int(f"run.{key}", getattr(self, key), low,
                     none_ok=key in ("num_to_keep", "min_workers"), error=JobError)
        read_str("run.storage_path", self.storage_path, none_ok=True, error=JobError,
                 hint=" (a directory path or a URI such as s3://bucket/runs)")
        read_str("run.storage_endpoint", self.storage_endpoint, none_ok=True, error=JobError,
                 hint=" (an S3 server's URL such as http://10.0.0.5:9000)")
        if self.storage_endpoint is not None and self.storage_path is None:
            raise JobError("run.storage_endpoint is set but run.storage_path is not: write "
                           "storage_path: s3://BUCKET/path (the bucket on that server).")
        if self.storage_path is not None:
            try:  # the text only: the server itself is asked on the driver before Ray
                check_location(self.storage_path, self.storage_endpoint)
            except StorageURIError as exc:
                raise JobError(f"run.{exc}") from None


def _keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


TOP_KEYS = ("name", "train", "config", "mesh", "scaling", "network", "run", "data", "replicate",
            "plan", "layout", "replica_groups")
SCALING_KEYS = _keys(ScalingSection)
OPTION_KEYS = tuple(k for k in OPTION_NAMES if k != "verbose")  # verbose: the command line's
NETWORK_KEYS = (*OPTION_KEYS, "backend", "timeout_s")
RUN_KEYS = _keys(RunSection)


def _overridden(source: Any, num_workers: int | None, storage_path: str | None,
                endpoint: str | None) -> Any:
    """A job file's mapping with the given overrides in its ``scaling:``/``run:`` (``source``
    itself when none is given, or it is no mapping: its own check names that)."""
    out = source
    for section, changes in (("scaling", {"num_workers": num_workers}),
                             ("run", {"storage_path": storage_path,
                                      "storage_endpoint": endpoint})):
        changes = {k: v for k, v in changes.items() if v is not None}
        if changes and isinstance(source, dict):
            given = source.get(section)
            out = {**out, section: {**given, **changes} if isinstance(given, dict)
                   else changes}
    return out


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
    layout: Layout | None = None  # the run's layout (mesh, replicate and the rest); None: auto
    plan: Any = None  # a ray_mesh.planning.inputs.PlanInputs (the plan: section), or None
    base_dir: Path = field(default_factory=Path.cwd)
    data: Any = None
    """The checked ``data:`` section (a ray_mesh.data.spec.DataSpec), or None."""
    source: dict | None = field(default=None, compare=False, repr=False)
    """The mapping this job was parsed from (overrides re-parse it), or None."""
    replica_groups: Any = None
    """The checked ``replica_groups:`` section (cli.job_groups.ReplicaGroupsSection), or
    None: a run of replica groups instead of one mesh."""

    def __post_init__(self) -> None:
        if self.run.min_workers is not None and self.run.min_workers > self.scaling.num_workers:
            raise JobError(f"run.min_workers={self.run.min_workers} is above "
                           f"scaling.num_workers={self.scaling.num_workers} (the maximum of an "
                           f"elastic run). Lower it.")

    def trainer_inputs(self) -> tuple[dict[str, Any] | None, dict]:
        """``(datasets, train_loop_config)`` for ``TorchTrainer``: with a ``data:`` section,
        its Ray Data datasets (``ray_mesh.data.ray_datasets``, the section's one entry
        point, whatever the format) and the checked section under ``config["data"]``."""
        if self.data is None:
            return None, self.config
        from ray_mesh.data import ray_datasets

        return ray_datasets(self.data), {**self.config, "data": self.data.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | None = None) -> Job:
        if data is None:
            raise JobError("The job file is empty: it needs at least a train: key, e.g. "
                           "train: path/to/file.py:function (see examples/hsdp.yaml).")
        if not isinstance(data, dict):
            raise JobError(f"A job file's top level must be a mapping of keys (name:, train:, "
                           f"mesh:, scaling:, ...); got {describe(data)}.")
        top = check_keys("job", data, TOP_KEYS)
        if "train" not in top:
            raise JobError("The job has no 'train' key: name the train function as "
                           "'path/to/file.py:function' or 'package.module:function'.")
        check_train_ref(top["train"])
        groups = None
        if top.get("replica_groups") is not None:  # a run of replica groups, not one mesh
            from ray_mesh.cli.job_groups import KEYS, ReplicaGroupsSection, check_alongside

            check_alongside(top)
            groups = ReplicaGroupsSection(**check_keys("replica_groups",
                                                       top["replica_groups"], KEYS))
        config = {} if top.get("config") is None else top["config"]
        if not isinstance(config, dict):
            raise JobError(f"config must be a mapping (the train function's config, e.g. "
                           f"config: {{steps: 40}}); got {describe(config)}.")
        given = _layout_section(top)
        if given is not None:
            top = {**top, "mesh": given.mesh}
        mesh, plan = _mesh_and_plan(top, base_dir or Path.cwd(), config)
        name = top.get("name") or Path(str(top["train"]).split(":")[0]).stem
        if isinstance(name, int) and not isinstance(name, bool):
            name = str(name)  # `name: 2024` in YAML
        why = run_name_problem(name)
        if why:
            raise JobError(f"name: {name!r} cannot be a run name: {why}. The run directory is "
                           f"<storage_path>/<name>: use one plain path component such as "
                           f"'hsdp_run1'; to write elsewhere, set run.storage_path.")
        scaling = ScalingSection(**check_keys("scaling", top.get("scaling"), SCALING_KEYS))
        from ray_mesh.data.spec import DataSpecError, parse_job_data

        try:  # files, split, batch vs dp, seq_len vs the model: all before any worker
            if groups is not None:  # one group's step is the batch
                from ray_mesh.cli.job_groups import parse_group_data

                data_spec = parse_group_data(top.get("data"), groups, base_dir or Path.cwd(),
                                             config)
            else:
                data_spec = parse_job_data(top.get("data"), base_dir or Path.cwd(),
                                           mesh=None if mesh == "auto" else mesh,
                                           num_workers=scaling.num_workers, config=config)
        except DataSpecError as exc:
            raise JobError(str(exc)) from exc
        try:
            replicate = (given.diloco if given is not None
                         else parse_replicate(top.get("replicate")))
            layout = None if mesh == "auto" else replace(given or Layout(), mesh=mesh,
                                                         diloco=replicate)
        except (ParallelError, LayoutError) as exc:
            raise JobError(str(exc)) from exc
        run = RunSection(**check_keys("run", top.get("run"), RUN_KEYS))
        if groups is not None and "max_failures" in (top.get("run") or {}):
            groups = replace(groups, max_group_failures=run.max_failures)  # per group
        if mesh != "auto" and groups is None:  # before Ray starts, not at its bring-up
            check_mesh_fits(mesh, scaling.num_workers, run.min_workers)
        return cls(
            replicate=replicate,
            layout=layout,
            name=name,
            train=str(top["train"]),
            config=config,
            mesh=mesh,
            scaling=scaling,
            network=NetworkSection.from_dict(top.get("network")),
            run=run,
            base_dir=base_dir or Path.cwd(),
            data=data_spec,
            plan=plan,
            source=data,
            replica_groups=groups,
        )

    @classmethod
    def from_yaml(cls, path: str | Path, *, num_workers: int | None = None,
                  storage_path: str | None = None, storage_endpoint: str | None = None) -> Job:
        """The job file at ``path``, parsed once, with ``ray-mesh run``'s overrides (where
        not None) put in before its checks: ``--num-workers`` (``scaling.num_workers``),
        ``--storage-path``/``--storage-endpoint`` (``run.storage_path``/``storage_endpoint``).
        An override the checks refuse is named (the file without it is parsed again then,
        to tell the two apart)."""
        path = Path(path).expanduser()
        source = load_yaml(path, error=JobError)
        base_dir = path.resolve().parent
        given = _overridden(source, num_workers, storage_path, storage_endpoint)
        if given is source:
            return cls.from_dict(source, base_dir=base_dir)
        try:
            return cls.from_dict(given, base_dir=base_dir)
        except JobError as exc:
            if num_workers is None:
                raise
            try:  # the file with the other overrides: does it pass without --num-workers?
                cls.from_dict(_overridden(source, None, storage_path, storage_endpoint),
                              base_dir=base_dir)
            except JobError:
                raise exc from None
            raise JobError(f"--num-workers {num_workers}: {exc}") from exc

    def with_storage(self, storage_path: str | None, endpoint: str | None) -> Job:
        """This job with ``run.storage_path``/``run.storage_endpoint`` replaced where given,
        re-checked (a job file's run is given them in :meth:`from_yaml`, parsed once)."""
        if self.source is None:
            changes = {k: v for k, v in (("storage_path", storage_path),
                                         ("storage_endpoint", endpoint)) if v is not None}
            return replace(self, run=replace(self.run, **changes))
        return Job.from_dict(_overridden(self.source, None, storage_path, endpoint),
                             base_dir=self.base_dir)

    def with_num_workers(self, num_workers: int) -> Job:
        """This job on ``num_workers`` workers, re-checked: a job parsed from a file is
        parsed again with the new count, so it goes through every check the file's own
        value does (mesh, data batch vs dp, min_workers)."""
        if self.source is None:
            return replace(self, scaling=replace(self.scaling, num_workers=num_workers))
        return Job.from_dict(_overridden(self.source, num_workers, None, None),
                             base_dir=self.base_dir)

    # ------------------------------------------------------------------ train function
    def load_train_fn(self) -> Callable[..., Any]:
        return load_function(self.train, self.base_dir)
