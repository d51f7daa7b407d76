"""Run by ``tests/test_parallel_torchrun.py`` under ``torchrun --nproc-per-node 4`` (gloo).

Every bad input of the issue on a real process group: each must raise ``ParallelError`` on
every rank, with a message naming the problem and the fix, within seconds (a hang would run
into the test's timeout instead). Also: data is sharded by dp rank (tp peers get the same
rows), and the hsdp example runs under torchrun. Rank 0 prints ``PASS <name>`` per check and
``ALL_DONE`` at the end; any failure raises and torchrun exits non-zero.
"""

from __future__ import annotations

import logging
import re
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parallel_checks as checks  # noqa: E402

import ray_mesh  # noqa: E402
from ray_mesh.parallel import (  # noqa: E402
    ParallelError,
    Pipeline,
    apply_fsdp,
    apply_tp,
    context_parallel_region,
    dp_rank,
    dp_size,
    shard_batch,
)


def expect(name: str, pattern: str, fn) -> None:
    """``fn()`` must raise ParallelError matching ``pattern`` here, on every rank, quickly."""
    start = time.monotonic()
    try:
        fn()
    except ParallelError as exc:
        if not re.search(pattern, str(exc), re.S):
            raise AssertionError(f"{name}: message {str(exc)!r} does not match {pattern!r}") \
                from exc
    else:
        raise AssertionError(f"{name}: no ParallelError")
    took = time.monotonic() - start
    # Every rank raised; the barrier proves none is left waiting in a collective.
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"PASS {name} ({took:.2f}s)", flush=True)


def mlp(n_layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict((f"fc{i}", nn.Linear(8, 8)) for i in range(n_layers)))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def full_parameters_quietly(mesh) -> None:
    """``full_parameters`` of a 2-D FSDP + TP model equals ``DTensor.full_tensor`` and logs
    nothing (torch's own gather warns on every rank that it cannot merge its all-gathers)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ray_mesh.parallel import full_parameters, parallelize

    model = nn.Sequential(OrderedDict(up=nn.Linear(8, 16), down=nn.Linear(16, 5)))
    model = parallelize(model, mesh, tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()})
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    torch_dtensor = logging.getLogger("torch.distributed.tensor")
    torch_dtensor.addHandler(handler)
    try:
        ours = full_parameters(model)
    finally:
        torch_dtensor.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]
    theirs = {n: p.full_tensor().cpu() for n, p in model.named_parameters()}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)
    if dist.get_rank() == 0:
        print("PASS full_parameters_fsdp_tp_quiet", flush=True)


def main() -> None:
    mesh = ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_replicate=2, dp_shard=-1))
    rank = dist.get_rank()

    # --- the hsdp example, as its __main__ runs it under torchrun
    hsdp = checks.load_example("hsdp")
    hsdp.train_loop({"steps": 3, "report_every": 1})
    if rank == 0:
        print("PASS hsdp_example_under_torchrun", flush=True)

    tp_mesh = checks.mesh_for(dp_replicate=1, dp_shard=2, tp=2)
    pp_mesh = checks.mesh_for(pp=2, dp_replicate=1, dp_shard=2)

    # --- hidden size not divisible by tp: the layer is named
    model = nn.Sequential(OrderedDict(embed=nn.Linear(8, 8), proj=nn.Linear(8, 7)))
    expect("tp_indivisible_hidden", r"layer 'proj' \(Linear\(8 -> 7\)\).*out_features=7.*tp=2",
           lambda: apply_tp(model, tp_mesh, {"embed": "colwise", "proj": "colwise"}))
    expect("tp_plan_typo", r"'prj' matches no submodule",
           lambda: apply_tp(model, tp_mesh, {"prj": "rowwise"}))

    # --- more pipeline stages than layers
    expect("pp_more_stages_than_layers", r"2 stages, but the model has only 1 layers",
           lambda: Pipeline(mlp(1), pp_mesh, loss_fn=mse, n_microbatches=2))
    expect("pp_interleaved_more_stages_than_layers", r"4 stages, but the model has only 3",
           lambda: Pipeline(mlp(3), pp_mesh, loss_fn=mse, n_microbatches=2,
                            schedule="interleaved_1f1b"))

    # --- microbatches that do not divide the batch: known up front ...
    expect("pp_microbatches_vs_batch_size", r"n_microbatches=4 does not divide the batch of 30",
           lambda: Pipeline(mlp(2), pp_mesh, loss_fn=mse, n_microbatches=4, batch_size=30,
                            dp="none"))
    # ... or only when a batch arrives (only stage 0 sees it; every rank must still raise)
    pipe = Pipeline(mlp(2), pp_mesh, loss_fn=mse, n_microbatches=4, dp="none")
    x, y = torch.randn(30, 8), torch.randn(30, 8)
    # The last stage gets a target of 28 rows, which 4 divides: on its own it would start the
    # schedule and wait in a recv for stage 0, which raised. The pp-group agreement stops it.
    expect("pp_microbatches_at_step", r"n_microbatches=4 does not divide the batch of 30",
           lambda: pipe.step(x if pipe.has_first else None,
                             target=None if pipe.has_first else y[:28]))
    loss = pipe.step(x[:28], target=y[:28])  # the same pipeline still runs a good batch
    assert torch.isfinite(loss), loss
    if rank == 0:
        print("PASS pp_good_batch_after_bad_one", flush=True)
    # forward_only: the last stage's output there, None elsewhere; eval is its deprecated name
    out = pipe.forward_only(x[:28])
    assert (out is not None) == pipe.has_last and (out is None or out.shape == (28, 8)), out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = pipe.eval(x[:28])
    assert any(issubclass(w.category, DeprecationWarning) and "forward_only" in str(w.message)
               for w in caught), caught
    assert (old is None and out is None) or torch.equal(old, out)
    if rank == 0:
        print("PASS pp_forward_only_and_deprecated_eval", flush=True)
    expect("pp_1f1b_too_few_microbatches", r"1F1B needs at least as many microbatches",
           lambda: Pipeline(mlp(2), pp_mesh, loss_fn=mse, n_microbatches=1))

    # --- a mesh without the dim a helper needs (not built by ray_mesh): one error everywhere
    plain = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("x",))
    expect("mesh_missing_dp_dim", r"no 'dp' dim \(dims: \('x',\)\).*ray_mesh.get_mesh\(\)",
           lambda: dp_rank(plain))
    expect("mesh_missing_pp_dim", r"no 'pp' dim \(dims: \('x',\)\).*a pp size",
           lambda: Pipeline(mlp(2), plain, loss_fn=mse, n_microbatches=2))

    # --- context parallel on gloo/CPU: an error, not wrong attention
    cp_mesh = checks.mesh_for(dp_replicate=1, dp_shard=2, cp=2)
    q = torch.randn(2, 4, 16, 8)
    expect("cp_on_gloo", r"needs CUDA GPUs with the NCCL backend.*'cpu'.*gloo",
           lambda: context_parallel_region(cp_mesh, [q], [2]))

    # --- a data-parallel mode the mesh cannot give
    expect("fsdp_mode_vs_mesh", r"'fsdp' does not fit the mesh \(dp_replicate=2",
           lambda: apply_fsdp(mlp(2), mesh, mode="fsdp"))

    # --- mixed precision: bf16 compute, fp32 parameters and gradients (FSDP2 policy)
    seen: list[torch.dtype] = []
    model = mlp(2)
    reference = mse(model(torch.ones(4, 8)), torch.zeros(4, 8)).item()
    model.fc0.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    model = apply_fsdp(model, mesh, mixed_precision="bf16")
    loss = mse(model(torch.ones(4, 8)).float(), torch.zeros(4, 8))
    loss.backward()
    assert seen == [torch.bfloat16], seen
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())
    assert abs(loss.item() - reference) <= 2e-2 * abs(reference), (loss.item(), reference)
    if rank == 0:
        print("PASS fsdp_bf16_mixed_precision", flush=True)
    expect("ddp_mixed_precision", r"mixed_precision is an FSDP2 option",
           lambda: apply_fsdp(mlp(2), checks.mesh_for(dp_replicate=4, dp_shard=1),
                              mixed_precision="bf16"))

    # --- data by dp rank, never by world rank: tp peers read the same rows
    coord = ray_mesh.MeshSpec(dp_shard=2, tp=2).resolve(4).coordinate(rank)
    assert (dp_rank(tp_mesh), dp_size(tp_mesh)) == (coord["dp"], 2), (rank, coord)
    rows = shard_batch(torch.arange(8.0).view(8, 1), tp_mesh)
    peers = [torch.zeros_like(rows) for _ in range(2)]
    dist.all_gather(peers, rows, group=tp_mesh.get_group("tp"))
    assert torch.equal(peers[0], peers[1]), peers
    assert rows.flatten().tolist() == [4.0 * coord["dp"] + i for i in range(4)], rows
    if rank == 0:
        print("PASS data_by_dp_rank", flush=True)

    # --- FSDP + TP parameters read back whole, with nothing on the console
    full_parameters_quietly(checks.mesh_for(dp_replicate=1, dp_shard=2, tp=2))

    dist.barrier()
    if rank == 0:
        print("ALL_DONE", flush=True)


if __name__ == "__main__":
    main()
    # Once main's FSDP models are gone: shutdown_mesh() frees their groups too (it warns
    # about groups something still holds, which could abort the rank at exit).
    ray_mesh.shutdown_mesh()
