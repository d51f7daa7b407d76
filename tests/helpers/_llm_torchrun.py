"""Run by ``tests/dist/test_llm_numerics.py`` under ``torchrun --nproc-per-node 4`` (gloo).

``numerics``: the llm example's Llama on dp_shard 2 x tp 2 (sequence parallel, FSDP2), and
its variants, against a one-process run of the same model on the same batches of standard
library text (3 SGD steps, float32; see ``_parallel_checks``). Also the tp-peer batch guard:
equal batches pass, different ones raise on every rank.

``resume``: the torchrun checkpoints of the example resume exactly, from the newest.

``numerics_resume``: both, one after the other, in one launch (the test module's fixture:
a torchrun start costs ~10 s of a 2-core machine), on resume's mesh (dp_shard 2 x tp 2;
the numerics checks build their own meshes and need only the process group). A second
``init_mesh`` after ``shutdown_mesh`` in one torchrun process hangs in gloo's rendezvous.

``train``: the example's own train loop (AdamW, warm-up + cosine, grad clipping) on a tiny
model and a small slice of the standard library; rank 0 prints its summary as JSON.

Rank 0 prints ``PASS <name>`` per check and ``ALL_DONE``; any failure exits non-zero.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parallel_checks as checks  # noqa: E402

import ray_mesh  # noqa: E402
from ray_mesh.data.checks import check_same_batch  # noqa: E402
from ray_mesh.parallel import ParallelError  # noqa: E402

DATA = {"paths": ["stdlib"], "seq_len": 32, "batch_size": 8, "validation": 0.05,
        "max_tokens": 40_000, "val_tokens": 4_096}
TINY = {"preset": "tiny", "max_seq_len": 64}
RESUME_MESH = ray_mesh.MeshSpec(dp_shard=-1, tp=2)


def _pass(name: str, extra: object = "") -> None:
    if dist.get_rank() == 0:
        print(f"PASS {name} {extra}", flush=True)


def numerics() -> None:
    # Tighter than the other examples' checks (1e-4): this model agrees to ~1e-7 here.
    checks.RTOL, checks.ATOL = 1e-5, 1e-6
    mesh = checks.mesh_for(dp_replicate=1, dp_shard=2, tp=2)
    base = {"model": TINY, "data": DATA}
    variants = {
        "llm_fsdp2_tp2_sp": {},
        "llm_fsdp2_tp2_no_sp": {"sequence_parallel": False},
        "llm_fsdp2_tp2_tied_ac": {"model": {**TINY, "tie_embeddings": True},
                                  "activation_checkpointing": True},
    }
    for name, extra in variants.items():
        result = checks.check(name, mesh, "llm", config={**base, **extra})
        _pass(name, json.dumps({k.split("/")[1]: v for k, v in result.items()}))
    # FSDP2-as-replicate under TP (dp_replicate 2 x tp 2).
    result = checks.check("llm_ddp2_tp2", checks.mesh_for(dp_replicate=2, dp_shard=1, tp=2),
                          "llm", config=base)
    _pass("llm_ddp2_tp2", json.dumps({k.split("/")[1]: v for k, v in result.items()}))

    # The tp-peer guard: the same rows pass, rows split by world rank raise on every rank.
    rows = torch.arange(64).view(8, 8)
    check_same_batch(rows, mesh, step=0)
    try:
        check_same_batch(rows + dist.get_rank(), mesh, step=3)
    except ParallelError as exc:
        assert "got different batches at step 3" in str(exc), exc
        assert "data-parallel rank" in str(exc), exc
    else:
        raise AssertionError("different batches on tp peers were not caught")
    dist.barrier()
    _pass("tp_peer_guard")


def train() -> None:
    ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_shard=-1, tp=2))
    ex = checks.load_example("llm")
    summary = ex.train_loop({
        "model": TINY, "steps": 80, "warmup": 10, "lr": 3e-3, "report_every": 20,
        "eval_every": 40, "checkpoint_every": 0,
        "data": {**DATA, "seq_len": 64, "batch_size": 16, "max_tokens": 400_000,
                 "val_tokens": 16_384}})
    if dist.get_rank() == 0:
        print("SUMMARY " + json.dumps(summary), flush=True)


def resume(out: Path, init: bool = True) -> None:
    """Checkpoints under torchrun: a run resumed from step 4 repeats steps 5..8 exactly, and
    with checkpoints at 4 and 8 on disk the newest one is taken."""
    if init:
        ray_mesh.init_mesh(RESUME_MESH)
    ex = checks.load_example("llm")
    cfg = {"model": TINY, "steps": 8, "warmup": 2, "report_every": 1, "eval_every": 100,
           "checkpoint_every": 4, "checkpoint_dir": str(out), "data": DATA}
    first = ex.train_loop(cfg)["losses"]
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(out / "checkpoint_00000008")
    dist.barrier()
    again = ex.train_loop(cfg)["losses"]
    assert sorted(again) == [5, 6, 7, 8], again
    for step in again:
        assert abs(again[step] - first[step]) <= 1e-6 * abs(first[step]), (step, again, first)
    _pass("llm_resume_repeats_steps", json.dumps({"first": first, "resumed": again}))
    more = ex.train_loop({**cfg, "steps": 10})["losses"]
    assert sorted(more) == [9, 10], more  # started from checkpoint 8, not 4
    _pass("llm_resume_takes_newest")


def main() -> None:
    mode = sys.argv[1]
    if mode == "numerics":
        ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_shard=-1))
        numerics()
    elif mode == "resume":
        resume(Path(sys.argv[2]))
    elif mode == "numerics_resume":
        ray_mesh.init_mesh(RESUME_MESH)
        numerics()
        dist.barrier()
        resume(Path(sys.argv[2]), init=False)
    else:
        train()
    dist.barrier()
    if dist.get_rank() == 0:
        print("ALL_DONE", flush=True)
    ray_mesh.shutdown_mesh()


if __name__ == "__main__":
    main()
