"""Two layouts, and a trial, one after the other in one process: neither sees the other's
settings; a layout passed with the worker's state wins over the one its mesh carries.
2 gloo ranks (spawned), real FSDP2 over ``dp_shard=2``.

Before the layout was held by the mesh, the pick (``set_picked_plan``) and the replicate mode
(``set_replicate_config``) were process globals that ``shutdown_mesh`` left behind: a second
mesh built in the same process (``init_mesh`` under torchrun, another run's bring-up, a
benchmark's local shape) reduced its gradients in the first one's dtype and wrapped its model
in the first one's DiLoCo. What is observed here is behaviour, not a flag: gradients
reduced in bf16 are exactly representable in bf16 after FSDP casts them back to fp32, and
gradients reduced in fp32 are not; ``replicate_config``/``dp_mode``/``wrap_replicate`` say
what the helpers would run."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
from pathlib import Path

from ports import free_port
from torchrun import spawn_ranks

WORLD = 2
FIRST = "dp_replicate=2/bf16/diloco:every=4,compress=int8"
SECOND = "dp_shard=2/fp32/sync"
TRIAL = "dp_shard=2/bf16/sync"


def _reduced_in_bf16(mesh, seed: int) -> bool:
    """Build a model with apply_fsdp's default precision, take one step's gradients, and say
    whether every gradient of this rank's shard is a bf16 value (the reduction ran in bf16)."""
    import torch
    from torch import nn

    from ray_mesh.parallel import parallelize

    torch.manual_seed(0)  # the same weights on every rank
    model = parallelize(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)), mesh)
    torch.manual_seed(seed + torch.distributed.get_rank())  # a different batch per rank
    model(torch.randn(16, 32)).square().mean().backward()
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for p in model.parameters()]
    exact = all(torch.equal(g, g.to(torch.bfloat16).float()) for g in grads)
    return exact


def _what_the_helpers_see(mesh=None) -> dict:
    from torch import nn

    from ray_mesh.parallel import layout_of, replicate_config, replicate_dp_mode, wrap_replicate

    cfg = replicate_config(mesh)
    dl = wrap_replicate(nn.Linear(2, 2), mesh) if cfg is not None else None
    lay = layout_of(mesh)
    return {"layout": str(lay) if lay else None, "diloco": cfg.every if cfg else None,
            "dp_mode": replicate_dp_mode(mesh), "wrapped": dl is not None}


def _every_helper(where) -> dict:
    """What each public helper that takes a mesh answers for ``where`` (a mesh or a state)."""
    import torch
    from torch import nn

    from ray_mesh import parallel as P

    rank = torch.distributed.get_rank()
    with P.context_parallel_region(where, [], []):
        pass  # cp=1: a no-op region, entered through the state or the mesh alike
    return {"dp_rank": P.dp_rank(where), "dp_size": P.dp_size(where),
            "local_batch": P.local_batch_size(8, where),
            "rows": P.shard_batch(torch.arange(8), where).tolist(),
            "dp_mean": P.dp_mean(torch.tensor(float(rank)), where).item(),
            "dp_shard": P.dim_size(where, "dp_shard"), "device": str(P.mesh_device(where)),
            "submesh": P.submesh(where, "dp_shard_cp").size(),
            "sampler": list(P.distributed_sampler(range(8), where, shuffle=False)),
            "resumable": list(P.resumable_sampler(8, where, shuffle=False)),
            "tp": type(P.apply_tp(nn.Linear(2, 2), where, {})).__name__}


def _worker(rank: int, ports: tuple[int, int], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    from ray_mesh.core import bootstrap
    from ray_mesh.core.layout import parse_layout
    from ray_mesh.planning.trial import run_trials

    def setup(layout: str | None, spec) -> object:
        return bootstrap.setup_worker(spec, rank=rank, world_size=WORLD, local_rank=rank,
                                      backend="gloo", device="cpu", timeout_s=60,
                                      layout=None if layout is None else parse_layout(layout))

    seen: dict = {}
    # 1. a run with bf16 reduction and DiLoCo (what mesh=auto may pick), then its shutdown
    first = parse_layout(FIRST)
    state = setup(FIRST, first.mesh)
    seen["first"] = _what_the_helpers_see()
    seen["first_state"] = _what_the_helpers_see(state)  # DiLoCo built from the state too
    gc.collect()  # the DiLoCo built above holds the mesh's groups
    bootstrap.shutdown_mesh()
    # 2. the next mesh in the same process, given no layout: fp32, sync. On its own port, as
    # the next run gets one: rank 1 may reach the port before rank 0 has closed its first
    # store there, and that store hangs up on it ("Failed to recv, got 0 bytes").
    os.environ["MASTER_PORT"] = str(ports[1])
    state = setup(None, parse_layout(SECOND).mesh)
    seen["second"] = {**_what_the_helpers_see(), "bf16": _reduced_in_bf16(state.mesh, 1)}
    # 2b. the worker's state passed instead of a mesh: the helpers follow the state's layout,
    # not the one its mesh carries (a state with another layout: a context the caller made)
    passed = dataclasses.replace(state, layout=parse_layout(TRIAL))
    seen["passed"] = {**_what_the_helpers_see(passed), "bf16": _reduced_in_bf16(passed, 4)}
    seen["every_helper"] = [_every_helper(state), _every_helper(state.mesh)]

    # 3. a trial of a bf16 layout while that mesh exists: the trial's own mesh carries it
    def make_step(mesh, config):
        config["box"]["trial"] = {**_what_the_helpers_see(mesh), "bf16": _reduced_in_bf16(mesh, 2)}
        # a slice of it too (torch copies no attribute onto a slice): its root's layout
        config["box"]["slice"] = _what_the_helpers_see(mesh["dp_shard"])
        return lambda: None

    record: dict = {"box": {}}  # run_trials hands make_step a copy of the mapping
    run_trials([parse_layout(TRIAL)], make_step, record, steps=1, budget_s=60)
    seen["trial"], seen["slice"] = record["box"]["trial"], record["box"]["slice"]
    # 4. and after it, the process's mesh is as it was
    seen["after_trial"] = {**_what_the_helpers_see(), "bf16": _reduced_in_bf16(state.mesh, 3)}
    gc.collect()
    bootstrap.shutdown_mesh()
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def test_layouts_and_trials_one_after_another_do_not_see_each_other(tmp_path):
    ports = (free_port(), free_port())
    spawn_ranks(_worker, (ports, str(tmp_path)), WORLD, 180, "layout isolation")
    for r in range(WORLD):
        seen = json.loads((tmp_path / f"{r}.json").read_text())
        assert seen["first"] == {"layout": FIRST, "diloco": 4, "dp_mode": "replica",
                                 "wrapped": True}, seen
        # nothing of the first run's bf16 reduction or DiLoCo is left for the second
        assert seen["second"] == {"layout": SECOND, "diloco": None, "dp_mode": "auto",
                                  "wrapped": False, "bf16": False}, seen
        assert seen["first_state"] == seen["first"], seen
        # every helper that takes a mesh takes the state, and answers the same
        by_state, by_mesh = seen["every_helper"]
        assert by_state == by_mesh and by_mesh["dp_size"] == 2, seen
        # a state passed: its layout, not its mesh's
        assert seen["passed"] == {"layout": TRIAL, "diloco": None, "dp_mode": "auto",
                                  "wrapped": False, "bf16": True}, seen
        # the trial's mesh reduces in its own dtype...
        assert seen["trial"] == {"layout": TRIAL, "diloco": None, "dp_mode": "auto",
                                 "wrapped": False, "bf16": True}, seen
        # a slice of the trial's mesh: the trial's layout, not none (fp32/sync)
        assert seen["slice"] == {k: v for k, v in seen["trial"].items() if k != "bf16"}, seen
        # ...and changed nothing for the process's mesh
        assert seen["after_trial"] == seen["second"], seen
