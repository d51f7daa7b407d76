"""YAML job files -> a configured TorchTrainer, with every input checked on the driver.

A job file::

    name: hsdp                          # run name (RunConfig.name)
    train: examples/hsdp.py:train_loop  # file path or package.module, then :function
    config: {steps: 40}                 # train_loop_config
    mesh: {dp_replicate: 2, dp_shard: -1}   # or: hsdp | fsdp | ddp
    scaling: {num_workers: 4, use_gpu: auto, resources_per_worker: {CPU: 1}}
    network: {interface: auto, bringup_timeout_s: 120}
    run: {storage_path: ./ray_results, max_failures: 0, num_to_keep: 3}
    replicate: {mode: diloco, every: 50, compress: int8}  # default mode: sync (HSDP)
    # run.min_workers: N makes the run elastic (num_workers is then the maximum);
    # run.startup_retries bounds the restarts of a group that cannot start (default 3).

Relative paths in ``train`` resolve against the job file's folder, then the working dir.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import cloudpickle

from ray_mesh.checkpointing.storage import run_name_problem
from ray_mesh.core.spec import MeshSpec, MeshSpecError, load_yaml
from ray_mesh.parallel.errors import ParallelError
from ray_mesh.parallel.replicate import check_mesh as check_replicate_mesh
from ray_mesh.parallel.replicate import parse_replicate


class JobError(ValueError):
    """A job file that cannot run; the message names the key and the fix."""


TOP_KEYS = ("name", "train", "config", "mesh", "scaling", "network", "run", "replicate")
SCALING_KEYS = ("num_workers", "use_gpu", "resources_per_worker", "placement_strategy")
NETWORK_KEYS = ("interface", "bringup_timeout_s", "allow_cross_node_inner", "backend",
                "timeout_s", "preflight", "preflight_timeout_s", "nccl_vpn_defaults")
RUN_KEYS = ("storage_path", "max_failures", "num_to_keep", "min_workers", "startup_retries")


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


def _check_run(run: dict, num_workers: int) -> dict:
    """run: values with the fix in the message (checkpointing and elasticity keys)."""
    for key, low in (("max_failures", -1), ("num_to_keep", 1), ("min_workers", 1),
                     ("startup_retries", -1)):
        value = run.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise JobError(f"run.{key} must be an int >= {low}, got {value!r}.")
    if run.get("min_workers", 1) > num_workers:
        raise JobError(f"run.min_workers={run['min_workers']} is above scaling.num_workers="
                       f"{num_workers} (the maximum of an elastic run). Lower it.")
    path = run.get("storage_path")
    if path is not None and not isinstance(path, str):
        raise JobError(f"run.storage_path must be a path or URI string, got {path!r}.")
    return run


@dataclass
class Job:
    name: str
    train: str
    config: dict = field(default_factory=dict)
    mesh: MeshSpec = field(default_factory=MeshSpec)
    scaling: dict = field(default_factory=dict)
    network: dict = field(default_factory=dict)
    run: dict = field(default_factory=dict)
    replicate: Any = None  # a DiLoCoConfig (replicate: {mode: diloco, ...}) or None (sync)
    base_dir: Path = field(default_factory=Path.cwd)

    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | None = None) -> Job:
        top = _check_keys("job", data, TOP_KEYS)
        if "train" not in top:
            raise JobError("The job has no 'train' key: name the train function as "
                           "'path/to/file.py:function' or 'package.module:function'.")
        try:
            mesh = MeshSpec.from_dict(top.get("mesh"))
        except MeshSpecError as exc:
            raise JobError(f"mesh: {exc}") from exc
        config = top.get("config") or {}
        if not isinstance(config, dict):
            raise JobError(f"'config' must be a mapping, got {config!r}.")
        scaling = _check_keys("scaling", top.get("scaling"), SCALING_KEYS)
        workers = scaling.get("num_workers", 4)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise JobError(f"scaling.num_workers must be a positive int, got {workers!r}.")
        use_gpu = scaling.get("use_gpu", "auto")
        if use_gpu not in (True, False, "auto"):
            raise JobError(f"scaling.use_gpu must be true, false or auto, got {use_gpu!r}.")
        name = top.get("name") or Path(str(top["train"]).split(":")[0]).stem
        if isinstance(name, int) and not isinstance(name, bool):
            name = str(name)  # `name: 2024` in YAML
        why = run_name_problem(name)
        if why:
            raise JobError(f"name: {name!r} cannot be a run name: {why}. The run directory is "
                           f"<storage_path>/<name>: use one plain path component such as "
                           f"'hsdp_run1'; to write elsewhere, set run.storage_path.")
        try:
            replicate = parse_replicate(top.get("replicate"))
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
            network=_check_keys("network", top.get("network"), NETWORK_KEYS),
            run=_check_run(_check_keys("run", top.get("run"), RUN_KEYS), workers),
            base_dir=base_dir or Path.cwd(),
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> Job:
        path = Path(path)
        try:
            data = load_yaml(path)
        except MeshSpecError as exc:
            raise JobError(str(exc)) from exc
        return cls.from_dict(data, base_dir=path.resolve().parent)

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
        # Workers cannot import a module that only exists on the driver: ship it by value.
        cloudpickle.register_pickle_by_value(module)
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
