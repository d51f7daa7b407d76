"""The NCCL path on a GPU machine, Ray-free (``torchrun --nproc-per-node N scripts/gpu_check.py``).

What CI cannot check (it has no GPU), each printed as ``PASS name figures`` or ``FAIL name``:

* the world process group on NCCL, bound to this rank's device (``device_id``);
* the mesh on ``cuda`` with its named dims, and a collective on every dim;
* ``use_device`` in another thread (Ray Train V2 runs the train function in a thread other
  than the backend's ``on_start``; CUDA's current device is per thread): a collective from
  that thread;
* ``probe_dims`` on CUDA (its timing synchronizes the device);
* FSDP2 (``fully_shard``, bf16 parameters, fp32 reduce) and tensor parallel
  (``parallelize_module``) on the mesh: a few optimizer steps, the loss falls;
* the sharded checkpoint (DCP) of that model saved and loaded back equal.

Rank 0 prints one JSON line ``SUMMARY {...}`` at the end; the exit code is non-zero on any
failure.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import ray_mesh
from ray_mesh.core.devices import use_device
from ray_mesh.parallel.compose import full_tensor

RESULTS: dict[str, object] = {}


def say(name: str, ok: bool, extra: object = "") -> None:
    RESULTS[name] = extra if ok else f"FAIL {extra}"
    if dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'} {name} {extra}", flush=True)


def check(name: str):
    def wrap(fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - every check reports and the others still run
            say(name, False, traceback.format_exc()[-1500:])
        return fn
    return wrap


def main() -> int:
    world = int(os.environ["WORLD_SIZE"])
    spec = {"dp_shard": -1} if world == 1 else {"dp_shard": -1, "tp": 2}
    t0 = time.perf_counter()
    mesh = ray_mesh.init_mesh(spec)
    state = ray_mesh.get_state()
    dev = state.device
    pg = dist.distributed_c10d._get_default_group()
    say("process_group", dist.get_backend() == "nccl" and dev.type == "cuda"
        and getattr(pg, "bound_device_id", None) == dev,
        {"backend": dist.get_backend(), "device": str(dev),
         "bound_device_id": str(getattr(pg, "bound_device_id", None)),
         "init_mesh_s": round(time.perf_counter() - t0, 3),
         "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
         "torch": torch.__version__})
    say("mesh_on_cuda", mesh.device_type == "cuda",
        {"dims": mesh.mesh_dim_names, "shape": tuple(mesh.shape)})

    @check("collective_each_dim")
    def _() -> None:
        got = {}
        for dim in mesh.mesh_dim_names:
            t = torch.ones(4, device=dev)
            dist.all_reduce(t, group=mesh.get_group(dim))
            got[dim] = float(t[0])
        say("collective_each_dim", all(v == mesh[d].size() for d, v in got.items()), got)

    @check("training_thread")
    def _() -> None:
        out: dict[str, object] = {}

        def body() -> None:
            use_device(dev)
            out["current"] = torch.cuda.current_device() if dev.type == "cuda" else None
            t = torch.full((2,), float(dist.get_rank()), device=dev)
            dist.all_reduce(t)
            out["sum"] = float(t[0])
        th = threading.Thread(target=body)
        th.start()
        th.join(60)
        want = float(sum(range(world)))
        say("training_thread", out.get("current") == dev.index and out.get("sum") == want, out)

    @check("probe_dims")
    def _() -> None:
        from ray_mesh.observability.metrics import probe_dims

        res = probe_dims(nbytes=64 << 20, iters=5, export=False)
        say("probe_dims", True, {d: {"s": round(s, 6), "busbw_GBps": round(bw / 1e9, 1)}
                                 for d, (s, bw) in res.items()} or "no dim of size > 1")

    @check("fsdp2_tp_steps")
    def _() -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(dev)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp_shard"], mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, 1024, device=dev, generator=torch.Generator(dev).manual_seed(1))
        y = torch.randn(64, 1024, device=dev, generator=torch.Generator(dev).manual_seed(2))
        losses = []
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda _: None)
        sync(dev)
        t = time.perf_counter()
        for _ in range(20):
            loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        sync(dev)
        step_ms = (time.perf_counter() - t) / 20 * 1e3
        say("fsdp2_tp_steps", losses[-1] < losses[0],
            {"loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
             "mean_step_ms": round(step_ms, 2),
             "peak_mem_MiB": round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
             if dev.type == "cuda" else None})

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        path = os.path.join(tempfile.gettempdir(), "gpu_check_dcp")
        before = {k: full_tensor(v).clone() for k, v in get_model_state_dict(model).items()}
        dcp.save(get_model_state_dict(model), checkpoint_id=path)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=path)
        same = all(torch.equal(before[k], full_tensor(v)) for k, v in sd.items())
        say("dcp_roundtrip", same, {"tensors": len(before)})

        # Replica groups of different layouts (ray_mesh.replicas.reshard) on NCCL: the
        # state's shards to full tensors and back, and the leader's broadcast to its group.
        from ray_mesh.replicas.reshard import leader_outcome, share_from_leader, to_full, to_local_
        from ray_mesh.replicas.state import tensors_and_likes

        state, likes = tensors_and_likes(model, opt, None, torch.zeros(3, dtype=torch.int64))
        t = time.perf_counter()
        full = to_full(state, likes)
        sync(dev)
        gather_ms = (time.perf_counter() - t) * 1e3
        shapes = all(f.shape == (lk.shape if lk is not None else s.shape)
                     for f, s, lk in zip(full, state, likes, strict=True))
        before_local = [s.clone() for s in state]
        share_from_leader(full)
        to_local_(state, [f * 2 for f in full], likes)
        doubled = all(torch.equal(s, b * 2) for s, b in zip(state, before_local, strict=True))
        ok, total = leader_outcome(True, 7.0)
        # One flat buffer per dtype on the device (what share_from_leader broadcasts over
        # NCCL) and back into the tensors: the same values, on the same device.
        from ray_mesh.replicas.flat import flat_by_dtype, scatter_back

        t = time.perf_counter()
        flats = flat_by_dtype(full, dev)
        copies = [torch.zeros_like(f) for f in full]
        scatter_back(copies, flats)
        sync(dev)
        flat_ms = (time.perf_counter() - t) * 1e3
        flat_ok = (all(f.device.type == dev.type for f in flats.values())
                   and all(torch.equal(c, f) for c, f in zip(copies, full, strict=True)))
        say("replica_full_exchange", shapes and doubled and ok and total == 7.0 and flat_ok,
            {"tensors": len(full), "dtensors": sum(lk is not None for lk in likes),
             "full_MiB": round(sum(f.numel() * f.element_size() for f in full) / 2**20, 1),
             "to_full_ms": round(gather_ms, 2), "flat_round_trip_ms": round(flat_ms, 2),
             "flat_dtypes": sorted(str(d) for d in flats), "device": str(full[0].device)})

    ray_mesh.shutdown_mesh()
    failed = [k for k, v in RESULTS.items() if isinstance(v, str) and v.startswith("FAIL")]
    if int(os.environ.get("RANK", 0)) == 0:
        print("SUMMARY " + json.dumps({"results": RESULTS, "failed": failed}, default=str),
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
