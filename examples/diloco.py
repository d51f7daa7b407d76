"""DiLoCo across nodes: the transformer of ``fsdp_tp_transformer.py``, replicas sync every H.

The job's ``replicate:`` section (``diloco.yaml``) sets the mode; this train function does
not hard-code it: ``replicate_dp_mode()`` shards the model inside a replica only under
DiLoCo (HSDP in sync mode), ``wrap_replicate`` returns the outer loop (None in sync mode),
and the Checkpointer saves each replica's state with the outer state.

    ray-mesh run examples/diloco.yaml
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from ray import cloudpickle

import ray_mesh
from ray_mesh.checkpointing import Checkpointer
from ray_mesh.parallel import parallelize, replicate_dp_mode, wrap_replicate


def _sibling(name: str):
    """The example module next to this file, shipped to the workers by value (as the job's
    own file is): workers need not have examples/ on their path."""
    spec = importlib.util.spec_from_file_location(f"ray_mesh_example_{name}",
                                                  Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    cloudpickle.register_pickle_by_value(module)
    return module


ex = _sibling("fsdp_tp_transformer")

DEFAULTS = {**ex.DEFAULTS, "steps": 40, "checkpoint_every": 10, "lr": 0.003}


def train_loop(config: dict) -> None:
    cfg = {**DEFAULTS, **(config or {})}
    state = ray_mesh.get_state()  # the mesh and the run's layout (replicate mode, dtype)
    mesh = state.mesh
    model = parallelize(ex.make_model(cfg), state, dp=replicate_dp_mode(state))
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    dl = wrap_replicate(model, state)  # None in replicate mode sync
    ckpt = Checkpointer(model, optim, every=cfg["checkpoint_every"], diloco=dl)
    start = ckpt.restore()
    for step in range(start.step, cfg["steps"]):
        x, y = ray_mesh.parallel.shard_batch(ex.batch(step, cfg), mesh)
        loss = ex.loss_fn(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if dl is not None:
            dl.step()  # the outer step, on the steps it is due
        metrics = {"loss": loss.item(), **(dl.metrics() if dl is not None else {})}
        # ray_mesh.report, through the Checkpointer (which saves when due): ray_mesh shows
        # rank 0's progress line (at most one a second) and exports the numbers from it.
        ckpt.report(step + 1, metrics, data_position={"next_step": step + 1})
    if dl is not None:
        dl.flush()  # with replicate.overlap, the last sync lands here
    ckpt.close()
