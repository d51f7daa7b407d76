"""Checks of a job file that are not one section's: the exception, unknown keys, the
backend name, and the ``train:`` reference (which file or module, loaded on the driver).

Split from :mod:`ray_mesh.cli.job` to keep each module short; ``job`` re-exports
``JobError`` and ``load_function``. Ray-free (``ray.cloudpickle`` only when a train file
is loaded, to ship it to the workers by value).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray_mesh.core.values import brief, describe, read_str
from ray_mesh.errors import JobError

BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def check_backend(where: str, backend: Any) -> None:
    """A torch.distributed backend name, or ``device:name`` pairs (``cpu:gloo,cuda:nccl``)."""
    if backend is None:
        return
    known = set(BACKENDS)
    try:  # plus any backend registered in this process (torch's Backend.register_backend)
        import torch.distributed as dist

        known |= {str(b).lower() for b in getattr(dist.Backend, "backend_list", [])}
    except Exception:  # noqa: BLE001 - without torch.distributed the static list stands
        pass
    names = [part.split(":")[-1] for part in backend.split(",")] \
        if isinstance(backend, str) and backend else [None]
    if any(n not in known for n in names):
        raise JobError(f"{where} must be a torch.distributed backend ({', '.join(BACKENDS)}, "
                       f"or cpu:gloo,cuda:nccl), or left out for gloo on CPU and nccl on GPU; "
                       f"got {describe(backend)}.")


def check_keys(section: str, data: Any, allowed: tuple[str, ...]) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobError(f"'{section}' must be a mapping, got {type(data).__name__}: "
                       f"{brief(data)}.")
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(key[:100], allowed, n=1) \
                if isinstance(key, str) else []
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise JobError(f"Unknown key {brief(key)} in '{section}'.{hint} Allowed: "
                           f"{allowed}.")
    return dict(data)


def check_mesh_fits(mesh: Any, num_workers: int, min_workers: int | None) -> None:
    """The mesh against ``scaling.num_workers`` (and an elastic range), on the driver.

    The same checks Ray Train's start runs (``raytrain.launch.check_cluster``), made here so
    that ``dp_shard: 3`` over 4 workers fails in a second, before Ray starts. A mesh with a
    ``nodes`` dim is left to bring-up (the node count is not known yet).
    """
    from ray_mesh.core.spec import NODES, MeshSpecError
    from ray_mesh.raytrain.elastic import check_elastic_mesh

    if min_workers is not None and min_workers > num_workers:
        return  # Job's own check names run.min_workers and the fix
    try:
        if min_workers is not None:
            check_elastic_mesh(mesh, min_workers, num_workers)
        elif NODES not in mesh.shape:
            mesh.resolve(num_workers)
    except MeshSpecError as exc:
        raise JobError(f"mesh: {exc} (In a job file the worker count is "
                       f"scaling.num_workers, or ray-mesh run --num-workers.)") from None


def check_train_ref(ref: Any) -> str:
    """``train:`` is a string ``target:function`` (the file is looked for at load time)."""
    read_str("train", ref, error=JobError,
             hint=" such as 'path/to/file.py:function' or 'package.module:function'")
    target, _, fn_name = ref.rpartition(":")
    if not target or not fn_name.isidentifier():
        raise JobError(f"train: {ref!r} must be 'path/to/file.py:function' or "
                       f"'package.module:function' (the ':function' part is missing).")
    return ref


def _train_file(target: str, base_dir: Path) -> Path:
    """The ``train:`` file: next to the job file (or under its folder), else in the working
    dir; an absolute path as given. A relative path that climbs out of both is refused."""
    given = Path(target).expanduser()
    if given.is_absolute():
        candidates = [given]
    else:
        candidates = [base_dir / given, Path.cwd() / given]
        inside = [c for c in candidates if c.resolve().is_relative_to(
            (base_dir if c == candidates[0] else Path.cwd()).resolve())]
        if not inside:
            raise JobError(f"train: {target!r} leads outside the job's folder {base_dir}: put "
                           f"the file beside the job file (or in a folder under it), or give "
                           f"its absolute path.")
        candidates = inside
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        folder = next((p for p in candidates if p.is_dir()), None)
        if folder is not None:
            raise JobError(f"train: {target!r} is a folder: name a Python file in it, "
                           f"'{target.rstrip('/')}/<file>.py:function'.")
        raise JobError(f"train: file {target!r} not found (looked in "
                       f"{', '.join(str(p.parent) for p in candidates)}).")
    if path.suffix != ".py":
        raise JobError(f"train: {target!r} is not a .py file: name the Python file holding the "
                       f"train function, 'path/to/file.py:function' (rename it to .py).")
    return path


def load_function(ref: str, base_dir: Path | None = None) -> Callable[..., Any]:
    """Import ``path/to/file.py:fn`` or ``package.module:fn``, with an error naming the fix."""
    check_train_ref(ref)
    target, fn_name = ref.rsplit(":", 1)
    base_dir = base_dir or Path.cwd()
    looks_like_file = (base_dir / target).is_file() or (Path.cwd() / target).is_file()
    if target.endswith(".py") or "/" in target or os.sep in target or looks_like_file:
        path = _train_file(target, base_dir)
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
            beside = base_dir / f"{target.replace('.', '/')}.py"
            fix = (f"Did you mean the file '{target.replace('.', '/')}.py:{fn_name}' beside "
                   f"the job file?" if beside.is_file() else "Is it installed, or on PYTHONPATH?")
            raise JobError(f"train: cannot import module {target!r}: {type(exc).__name__}: "
                           f"{exc}. {fix}") from exc
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
