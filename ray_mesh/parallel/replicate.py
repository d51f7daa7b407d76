"""The replicate dim's mode, sync or DiLoCo: parsed on the driver, read in the train function.

A job's ``replicate:`` section (YAML) or ``MeshConfig(replicate=...)`` says how the replicas
on ``dp_replicate`` (one per node, over the slow link) keep together:

- ``mode: sync`` (default): HSDP; every gradient is all-reduced across replicas every step.
- ``mode: diloco``: each replica trains on its own for ``every`` inner steps, then they
  average pseudo-gradients once (:mod:`ray_mesh.parallel.diloco`), e.g.
  ``replicate: {mode: diloco, every: 50, outer_lr: 0.7, outer_momentum: 0.9,
  compress: int8, streaming: 4}``.

The driver validates the section (:func:`parse_replicate`, :func:`check_mesh`); the backend
hands the result to every worker (:func:`set_replicate_config`), where the train function
reads it (:func:`replicate_config`) or simply calls :func:`wrap`, which returns ``None`` in
sync mode::

    model = parallelize(model, mesh, dp=dp_mode())      # 'replica' under DiLoCo, else 'auto'
    optim = torch.optim.AdamW(model.parameters())
    dl = wrap(model, mesh)                              # None in sync mode
    for step ...:
        loss.backward(); optim.step(); optim.zero_grad()
        if dl: dl.step()

Ray-free: under torchrun, call :func:`set_replicate_config` yourself or pass ``config=``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ray_mesh.errors import ParallelError
from ray_mesh.parallel.diloco import DiLoCo, DiLoCoConfig

MODES = ("sync", "diloco")

_current: DiLoCoConfig | None = None


def parse_replicate(data: Any) -> DiLoCoConfig | None:
    """The ``replicate:`` section as a :class:`DiLoCoConfig`, or None for sync mode.

    Accepts None, a mapping (``mode`` defaults to ``sync``), a ``DiLoCoConfig``, or the
    strings ``'sync'``/``'diloco'`` (DiLoCo with its defaults).
    """
    if data is None or isinstance(data, DiLoCoConfig):
        return data
    if isinstance(data, str):
        data = {"mode": data}
    if not isinstance(data, dict):
        raise ParallelError(f"replicate: {data!r} must be a mapping like "
                            "{mode: diloco, every: 50} (or mode: sync, the default)")
    mode = data.get("mode", "sync")
    if mode not in MODES:
        raise ParallelError(f"replicate.mode={mode!r}: use 'sync' (HSDP, all-reduce every "
                            "step) or 'diloco' (sync every `every` steps)")
    if mode == "sync":
        extra = sorted(set(data) - {"mode"})
        if extra:
            raise ParallelError(f"replicate: {extra} only apply to mode: diloco; add "
                                "mode: diloco or remove them")
        return None
    return DiLoCoConfig.from_dict(data)


def check_mesh(config: DiLoCoConfig | None, dp_replicate: Any) -> None:
    """Driver-side: DiLoCo needs a replicate dim to sync over (>= 2, 'nodes' or -1)."""
    if config is None:
        return
    if isinstance(dp_replicate, int) and 0 <= dp_replicate < 2:
        raise ParallelError(
            f"replicate.mode=diloco syncs replicas over dp_replicate, but the mesh has "
            f"dp_replicate={dp_replicate}: set mesh.dp_replicate: nodes (one replica per node) "
            f"or a size >= 2, or use replicate.mode: sync")


def set_replicate_config(config: DiLoCoConfig | None) -> None:
    """Set this process's replicate mode (the Ray backend does it on every worker)."""
    global _current
    if config is not None and not isinstance(config, DiLoCoConfig):
        raise ParallelError(f"set_replicate_config takes a DiLoCoConfig or None, not {config!r}")
    _current = config


def replicate_config() -> DiLoCoConfig | None:
    """This run's DiLoCo settings, or None in sync mode."""
    return _current


def dp_mode() -> str:
    """The ``dp=`` to give :func:`~ray_mesh.parallel.parallelize` for this replicate mode."""
    return "replica" if _current is not None else "auto"


def wrap(model: torch.nn.Module, mesh: DeviceMesh | None = None,
         config: DiLoCoConfig | None = None) -> DiLoCo | None:
    """A :class:`DiLoCo` around ``model`` when the replicate mode is diloco, else None.

    ``mesh`` defaults to ``ray_mesh.get_mesh()``, ``config`` to :func:`replicate_config`.
    The model must be sharded inside a replica only (``parallelize(..., dp=dp_mode())``).
    """
    config = config if config is not None else _current
    if config is None:
        return None
    if mesh is None:
        from ray_mesh.core.bootstrap import get_mesh

        mesh = get_mesh()
    return DiLoCo(model, mesh, config)


__all__ = ["MODES", "check_mesh", "dp_mode", "parse_replicate", "replicate_config",
           "set_replicate_config", "wrap"]
