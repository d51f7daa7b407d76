"""Worker side of the parallel tests: every layout against a single-process reference.

Ray-free, so the same checks run in Ray Train workers (``tests/test_parallel_ray.py``) and
under torchrun. Each check builds the parallel model from one seed on a mesh over all ranks,
trains ``STEPS`` steps of plain SGD on the same global batches as a single-process copy of the
model, and compares the loss of every step and every gathered (full) parameter at the end.

Tolerance: float32 throughout; the parallel runs sum in a different order (sharded matmuls,
reduce-scatter, microbatches), so losses and parameters must agree to ``RTOL``/``ATOL`` below,
about 100x the float32 rounding of these small models, and far below what a wrong gradient
(a missed all-reduce, a double count, a dropped microbatch) does after one SGD step.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ray_mesh.core.bootstrap import build_device_mesh
from ray_mesh.core.spec import MeshSpec
from ray_mesh.parallel import (
    Pipeline,
    dp_size,
    full_parameters,
    parallelize,
    shard_batch,
)
from ray_mesh.parallel.compose import gather_over

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 3
LR = 0.05
RTOL, ATOL = 1e-4, 2e-5


def load_example(name: str):
    """An example module by path (the examples folder is not a package)."""
    key = f"ray_mesh_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[key] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules[key]


def mesh_for(**dims: int):
    return build_device_mesh(MeshSpec(**dims).resolve(dist.get_world_size()), "cpu")


def side_by_side(**dims: int):
    """A 4-rank layout on 4 ranks, or twice side by side on 8 (one Ray fit runs them all):
    an extra pp=2 for layouts that do not pipeline (nothing they do touches pp), an extra
    dp_replicate x2 for pipelined ones (run with data parallel off, so the copies are apart)."""
    world = dist.get_world_size()
    if world == 8:
        if dims.get("pp", 1) == 1:
            dims = {**dims, "pp": 2}
        else:
            dims = {**dims, "dp_replicate": dims.get("dp_replicate", 1) * 2}
    elif world != 4:
        raise AssertionError(f"the 4-rank layouts run on 4 or 8 ranks, not {world}")
    return mesh_for(**dims)


def reference(make_model, loss_fn, batches) -> tuple[list[float], dict[str, torch.Tensor],
                                                     dict[str, torch.Tensor]]:
    """Losses, final and initial parameters of one process on the whole global batches."""
    model = make_model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, init


def compare(name: str, losses: list[float], params: dict[str, torch.Tensor],
            ref: tuple[list[float], dict, dict]) -> dict[str, float]:
    """Max differences; raises (on every rank) when they exceed the tolerance."""
    ref_losses, ref_params, init = ref
    if sorted(params) != sorted(ref_params):
        raise AssertionError(f"{name}: parameter names differ: {sorted(params)} vs "
                             f"{sorted(ref_params)}")
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    param_diff = max((params[n] - ref_params[n]).abs().max().item() for n in ref_params)
    moved = max((ref_params[n] - init[n]).abs().max().item() for n in ref_params)
    ok_loss = all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses,
                                                                       strict=True))
    ok_params = all(torch.allclose(params[n], ref_params[n], rtol=RTOL, atol=ATOL)
                    for n in ref_params)
    if not (ok_loss and ok_params):
        raise AssertionError(f"{name}: differs from the single-process reference: losses "
                             f"{losses} vs {ref_losses}, max parameter difference {param_diff}")
    if moved < 100 * ATOL:
        raise AssertionError(f"{name}: training moved the parameters by only {moved}; the "
                             f"comparison would prove nothing.")
    return {f"{name}/loss_diff": loss_diff, f"{name}/param_diff": param_diff,
            f"{name}/moved": moved, f"{name}/loss_first": losses[0],
            f"{name}/loss_last": losses[-1]}


def _dp_mean(loss: torch.Tensor, mesh) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=mesh.get_group("dp"))
    return loss.item() / dp_size(mesh)


def check(name: str, mesh, example: str, build: Any = None, *, shard: bool = True,
          config: dict | None = None) -> dict[str, float]:
    """Train the example's model as ``build(mesh, cfg)`` makes it (default: the example's own
    ``build``) and compare with the reference. ``shard=False`` feeds every rank the whole
    batch: for layouts with data parallel off, where each replica is an independent run."""
    ex = load_example(example)
    cfg = {**ex.DEFAULTS, **(config or {})}
    batches = [ex.batch(s, cfg) for s in range(STEPS)]
    ref = reference(lambda: ex.make_model(cfg), ex.loss_fn, batches)
    model = (build or ex.build)(mesh, cfg)
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        if shard:
            x, y = shard_batch((x, y), mesh)
        if isinstance(model, Pipeline):
            loss = model.step(x, target=y)
        else:
            loss = ex.loss_fn(model(x), y)
            loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(_dp_mean(loss, mesh) if shard else loss.item())
    if isinstance(model, Pipeline):
        params = gather_over(mesh["pp"], full_parameters(model.modules))
    else:
        params = full_parameters(model)
    return compare(name, losses, params, ref)


def _pipeline(example: str, **kw: Any):
    ex = load_example(example)

    def build(mesh, cfg: dict) -> Pipeline:
        return Pipeline(ex.make_model(cfg), mesh, loss_fn=ex.loss_fn,
                        n_microbatches=cfg["microbatches"], **kw)
    return build


def four_rank_checks(config: dict | None = None) -> dict[str, float]:
    """Every 4-rank layout of the issue, each on its own mesh over the same ranks."""
    tf = load_example("fsdp_tp_transformer")
    mlp = load_example("tp_pp_mlp")
    r: dict[str, float] = {}
    # tp=2 alone: two independent TP pairs (dp off), sequence parallel transformer.
    r |= check("tp2", side_by_side(dp_replicate=2, dp_shard=1, tp=2), "fsdp_tp_transformer",
               lambda m, c: parallelize(tf.make_model(c), m, tp_plan=tf.tp_plan(), dp="none"),
               shard=False)
    # HSDP 2x2: the hsdp example's build (shard inside, replicate across).
    r |= check("hsdp2x2", side_by_side(dp_replicate=2, dp_shard=2), "hsdp")
    # Replicate-only: torch DDP over 4 ranks; FSDP2-as-replicate under TP (dp 2 x tp 2).
    r |= check("ddp4", side_by_side(dp_replicate=4, dp_shard=1), "hsdp")
    r |= check("ddp2_tp2", side_by_side(dp_replicate=2, dp_shard=1, tp=2), "tp_pp_mlp",
               lambda m, c: parallelize(mlp.make_model(c), m, tp_plan=mlp.TP_PLAN))
    # fsdp x tp 2x2: the transformer example's build (TP + SP, then FSDP2 per layer).
    r |= check("fsdp2_tp2", side_by_side(dp_replicate=1, dp_shard=2, tp=2),
               "fsdp_tp_transformer")
    # pp=2 alone (dp off: two independent pipelines), one schedule of each family.
    pp2 = side_by_side(pp=2, dp_replicate=2, dp_shard=1)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv"):
        r |= check(f"pp2_{schedule}", pp2, "tp_pp_mlp",
                   _pipeline("tp_pp_mlp", schedule=schedule, dp="none"), shard=False)
    # pp x tp 2x2: the blog layout (the tp_pp_mlp example's plan, 1F1B, 4 microbatches).
    r |= check("pp2_tp2", side_by_side(pp=2, dp_replicate=1, dp_shard=1, tp=2), "tp_pp_mlp",
               _pipeline("tp_pp_mlp", schedule="1f1b", tp_plan=mlp.TP_PLAN, dp="none"),
               shard=False)
    return r


def eight_rank_checks(config: dict | None = None) -> dict[str, float]:
    """On 8 ranks: the 3-D layout pp 2 x dp_shard 2 x tp 2 (the pp_hsdp_tp example's build,
    interleaved 1F1B), and pipelines with data parallel per stage: HSDP 2x2 and DDP 4."""
    r = check("pp2_fsdp2_tp2", mesh_for(pp=2, dp_replicate=1, dp_shard=2, tp=2), "pp_hsdp_tp")
    r |= check("pp2_hsdp2x2", mesh_for(pp=2, dp_replicate=2, dp_shard=2), "tp_pp_mlp",
               _pipeline("tp_pp_mlp", schedule="gpipe"))
    r |= check("pp2_ddp4", mesh_for(pp=2, dp_replicate=4, dp_shard=1), "tp_pp_mlp",
               _pipeline("tp_pp_mlp", schedule="1f1b"))
    return r


def _save(config: dict, results: dict[str, float]) -> None:
    """Write this rank's differences to <out>/<rank>.json for the driver to read."""
    import json

    out = Path(config["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{dist.get_rank()}.json").write_text(json.dumps(results))


def train_all(config: dict) -> None:
    """Ray Train entry point on 8 workers: the 4-rank layouts side by side, then the 3-D one;
    every rank's differences saved for the driver."""
    results = four_rank_checks(config)
    results |= eight_rank_checks(config)
    _save(config, results)


def meshconfig_checks(config: dict) -> None:
    """Ray Train entry point on 4 workers whose mesh ``MeshConfig(mesh=pp 2 x tp 2)`` built:
    a TP layout and a pipeline, both on ``ray_mesh.get_mesh()`` itself (no mesh made here),
    so the whole user path (MeshConfig -> get_mesh -> parallelize / Pipeline) is checked."""
    import ray_mesh

    mesh = ray_mesh.get_mesh()
    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    tf = load_example("fsdp_tp_transformer")
    mlp = load_example("tp_pp_mlp")
    # TP 2 with data parallel off: the two pp coordinates run independent TP pairs.
    r = check("mc_tp2", mesh, "fsdp_tp_transformer",
              lambda m, c: parallelize(tf.make_model(c), m, tp_plan=tf.tp_plan(), dp="none"),
              shard=False)
    # PP 2 x TP 2 (the blog layout, 1F1B) on the same mesh.
    r |= check("mc_pp2_tp2", mesh, "tp_pp_mlp",
               _pipeline("tp_pp_mlp", schedule="1f1b", tp_plan=mlp.TP_PLAN, dp="none"),
               shard=False)
    _save(config, {**r, **{f"mesh/{d}": float(n) for d, n in sizes.items()}})

