"""Run by ``tests/dist/test_diloco.py`` under ``torchrun --nproc-per-node 4`` (gloo).

Mesh dp_replicate=2 x dp_shard=2 (two "nodes" of two ranks). Each check prints ``PASS name``
on rank 0 or raises on every rank.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import ray_mesh
from ray_mesh.checkpointing import replicas, sharded
from ray_mesh.errors import ParallelError
from ray_mesh.parallel import apply_fsdp, full_parameters, parallelize, shard_batch
from ray_mesh.parallel.compress import average
from ray_mesh.parallel.diloco import DiLoCo, DiLoCoConfig, replicas_equal


def make_model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def train(model, optim, steps, mesh, diloco=None, start=0):
    for step in range(start, start + steps):
        x, y = shard_batch(batch(step), mesh)
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
        if diloco is not None:
            diloco.step()


def check(name: str, ok: bool, detail: str = "") -> None:
    if not ok:
        raise AssertionError(f"{name}: {detail}")
    if dist.get_rank() == 0:
        print(f"PASS {name}", flush=True)


def equals_sync_hsdp(mesh) -> None:
    """every=1, outer lr 1, momentum 0 with an SGD inner optimizer is sync data parallel."""
    ref = parallelize(make_model(), mesh)  # HSDP: dp_replicate x dp_shard
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    train(ref, opt, 4, mesh)
    model = parallelize(make_model(), mesh, dp="replica")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dl = DiLoCo(model, mesh, DiLoCoConfig(every=1, outer_lr=1.0, outer_momentum=0.0,
                                          nesterov=False))
    train(model, opt, 4, mesh, dl)
    a, b = full_parameters(ref), full_parameters(model)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    check("h1_lr1_m0_equals_sync_hsdp",
          all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a), f"max {worst}")


def outer_step_by_hand(mesh) -> None:
    """One outer step against the formula, on every rank's own shard."""
    model = parallelize(make_model(), mesh, dp="replica")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = DiLoCoConfig(every=3, outer_lr=0.7, outer_momentum=0.9)
    dl = DiLoCo(model, mesh, cfg)
    start = [g.clone() for g in dl.global_params]
    train(model, opt, 2, mesh, dl)  # no sync yet
    check("no_sync_before_h", dl.outer_steps == 0 and not replicas_equal(
        model, mesh.get_group("dp_replicate")), "replicas should have drifted apart")
    train(model, opt, 1, mesh)  # third inner step, sync by hand to see the inputs
    local = [p.to_local().detach().clone() for p in model.parameters()]
    rep = mesh.get_group("dp_replicate")
    expected = []
    for g0, loc in zip(start, local, strict=True):
        d = g0 - loc
        dist.all_reduce(d, group=rep)
        d /= 2
        m = d.clone()  # momentum from zero
        expected.append(g0 - 0.7 * (d + 0.9 * m))  # Nesterov
    dl.inner_steps += 1
    dl.sync()
    got = [p.to_local() for p in model.parameters()]
    check("outer_step_equals_formula",
          all(torch.allclose(e, g, rtol=1e-6, atol=1e-7) for e, g in zip(expected, got,
                                                                          strict=True)))
    check("replicas_bitwise_equal_after_sync", replicas_equal(model, rep))


def compressed_syncs(mesh) -> None:
    rep = mesh.get_group("dp_replicate")
    for mode in ("none", "bf16", "int8"):
        model = parallelize(make_model(), mesh, dp="replica")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        dl = DiLoCo(model, mesh, DiLoCoConfig(every=2, compress=mode, streaming=2))
        train(model, opt, 6, mesh, dl)
        # Streaming: fragment 0 syncs at steps 2, 4, 6; fragment 1 at 3, 5 (offset every/2).
        check(f"streaming_schedule_{mode}", [dl.due(s) for s in range(1, 7)]
              == [[], [0], [1], [0], [1], [0]], str([dl.due(s) for s in range(1, 7)]))
        dl.sync()  # a full sync at the end: every fragment equal across replicas
        check(f"replicas_equal_{mode}", replicas_equal(model, rep))


def save(path: Path, dl: DiLoCo, model, opt, step: int) -> None:
    """A complete DiLoCo checkpoint, as ``Checkpointer(diloco=...)`` writes it: the state
    laid out per replica (:mod:`ray_mesh.checkpointing.replicas`), then manifest and marker."""
    replicas.save(path, dl, model, opt)
    sharded.mark_complete(path, sharded.Progress(step=step))


def checkpoint_resume_bitwise(mesh) -> None:
    """Save at an inner step between syncs, restore into fresh objects, continue: bitwise."""
    def build():
        model = parallelize(make_model(), mesh, dp="replica")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, opt, DiLoCo(model, mesh, DiLoCoConfig(every=2, compress="int8"))

    model, opt, dl = build()
    train(model, opt, 7, mesh, dl)
    straight = full_parameters(model)
    model, opt, dl = build()
    train(model, opt, 3, mesh, dl)
    saved = (full_parameters(model), [g.clone() for g in dl.global_params],
             [m.clone() for m in dl.momentum], [e.clone() for e in dl.error])
    path = scratch() / "ckpt"
    save(path, dl, model, opt, step=3)
    model, opt, dl = build()
    progress = replicas.load(path, dl, model, opt)
    check("own_replica_found", progress.step == 3 and not progress.warnings,
          str(progress.warnings))
    check("counters_restored", dl.inner_steps == 3, str(dl.inner_steps))
    now = full_parameters(model)
    check("model_restored", all(torch.equal(saved[0][k], now[k]) for k in now))
    check("outer_state_restored", all(
        torch.equal(a, b) for old, new in zip(saved[1:], (dl.global_params, dl.momentum,
                                                           dl.error), strict=True)
        for a, b in zip(old, new, strict=True)))
    train(model, opt, 4, mesh, dl, start=3)
    resumed = full_parameters(model)
    check("resume_bitwise", all(torch.equal(straight[k], resumed[k]) for k in straight))


def overlapped_sync(mesh) -> None:
    """overlap=1: the sync leaves at step 3 and lands at step 4, keeping step 4's progress:
    local = (global - lr * mean(global - local_3)) + (local_4 - local_3)."""
    rep = mesh.get_group("dp_replicate")
    for mode in ("none", "int8"):
        model = parallelize(make_model(), mesh, dp="replica")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        dl = DiLoCo(model, mesh, DiLoCoConfig(every=3, outer_lr=0.7, outer_momentum=0.0,
                                              nesterov=False, compress=mode,
                                              error_feedback=False, overlap=1))
        g0 = [g.clone() for g in dl.global_params]
        train(model, opt, 2, mesh, dl)
        train(model, opt, 1, mesh)  # step 3's inner step; dl.step() by hand below
        sent = [p.to_local().detach().clone() for p in model.parameters()]
        landed_at_send = dl.step()  # step 3: the sync leaves, nothing lands yet
        check(f"overlap_nothing_lands_at_send_{mode}",
              not landed_at_send and len(dl._in_flight) == 1 and dl.outer_steps == 0)
        train(model, opt, 1, mesh)  # step 4's inner step while the sync is in flight
        now = [p.to_local().detach().clone() for p in model.parameters()]
        check(f"overlap_lands_one_step_later_{mode}", dl.step() and dl.outer_steps == 1)
        # what the wire carried: one flat buffer of every parameter's pseudo-gradient
        flat = torch.cat([(g - s3).reshape(-1) for g, s3 in zip(g0, sent, strict=True)])
        avg = average(flat, mode, rep).split([g.numel() for g in g0])
        expected = [(g - 0.7 * d.view_as(g)) + (s4 - s3)
                    for g, d, s3, s4 in zip(g0, avg, sent, now, strict=True)]
        got = [p.to_local() for p in model.parameters()]
        check(f"overlap_keeps_inflight_steps_{mode}",
              all(torch.allclose(e, x, rtol=1e-6, atol=1e-7)
                  for e, x in zip(expected, got, strict=True)))
        check(f"overlap_globals_bitwise_equal_{mode}", dl.globals_equal())
        check(f"overlap_replicas_differ_by_inflight_steps_{mode}",
              not replicas_equal(model, rep))
        train(model, opt, 2, mesh, dl)  # step 6 sends again ...
        check(f"overlap_flush_lands_{mode}", dl.flush() and not dl._in_flight
              and dl.outer_steps == 2)
        dl.sync()
        check(f"overlap_full_sync_equalizes_{mode}", replicas_equal(model, rep))


def overlap_checkpoint_resume_bitwise(mesh) -> None:
    """A save with a sync in flight lands it first: resuming equals a run that flushed
    at the same step."""
    def build():
        model = parallelize(make_model(), mesh, dp="replica")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, opt, DiLoCo(model, mesh, DiLoCoConfig(every=2, compress="int8",
                                                             overlap=1))

    model, opt, dl = build()
    train(model, opt, 4, mesh, dl)
    check("overlap_in_flight_at_save_step", len(dl._in_flight) == 1)
    dl.flush()
    train(model, opt, 3, mesh, dl, start=4)
    dl.flush()
    straight = full_parameters(model)
    model, opt, dl = build()
    train(model, opt, 4, mesh, dl)
    path = scratch() / "ckpt"
    save(path, dl, model, opt, step=4)
    model, opt, dl = build()
    replicas.load(path, dl, model, opt)
    train(model, opt, 3, mesh, dl, start=4)
    dl.flush()
    resumed = full_parameters(model)
    check("overlap_resume_bitwise", all(torch.equal(straight[k], resumed[k])
                                        for k in straight))


_SCRATCH: list[Path] = []  # rank 0's checkpoint folders, removed when the script ends


def scratch() -> Path:
    """A new folder every rank sees (rank 0 makes it), removed at the end of :func:`main`."""
    tmp = tempfile.mkdtemp(prefix="diloco_ckpt_") if dist.get_rank() == 0 else None
    path = Path(sharded.broadcast_from_rank0(tmp, None))
    _SCRATCH.append(path)
    return path


def bad_inputs(mesh) -> None:
    hsdp = parallelize(make_model(), mesh)
    try:
        DiLoCo(hsdp, mesh)
    except ParallelError as exc:
        check("refuses_hsdp_model", "dp='replica'" in str(exc), str(exc))
    else:
        raise AssertionError("an HSDP model was accepted")
    model = apply_fsdp(make_model(), mesh, mode="replica")
    try:
        DiLoCo(model, mesh, dim="tp")
    except ParallelError as exc:
        check("refuses_size1_replicate_dim", "size 1" in str(exc), str(exc))
    else:
        raise AssertionError("a size-1 replicate dim was accepted")


def main() -> None:
    mesh = ray_mesh.init_mesh({"dp_replicate": 2, "dp_shard": 2})
    equals_sync_hsdp(mesh)
    outer_step_by_hand(mesh)
    compressed_syncs(mesh)
    checkpoint_resume_bitwise(mesh)
    overlapped_sync(mesh)
    overlap_checkpoint_resume_bitwise(mesh)
    bad_inputs(mesh)
    dist.barrier()
    if dist.get_rank() == 0:
        for path in _SCRATCH:
            shutil.rmtree(path, ignore_errors=True)
        print("ALL_DONE", flush=True)
    ray_mesh.shutdown_mesh()


if __name__ == "__main__":
    sys.exit(main())
