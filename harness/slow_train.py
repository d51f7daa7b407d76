"""A train loop with a slow rank (a busy loop) or a slow link: what the wait sampler names.

Shared by the torchrun test (tests/dist/test_slow_torchrun.py), the netns test
(tests/netns/test_slow_netns.py) and benchmarks/slow.py. Each step: an MLP forward/backward
(compute), then the flat gradient all-reduced on dp_shard, then on dp_replicate (HSDP's
order), with plain ``dist.all_reduce`` calls: no ray_mesh code on the training path, the
sampler (``ray_mesh.observability.waits``) has to find them by itself. ``slow_rank`` spins
``busy_s`` more seconds of Python per step.

Config keys: steps or duration_s, slow_rank (None), busy_s, width (MLP width: the gradient
is ~2 * width**2 floats), stop_file (a path: stop when it exists), fsdp (True: FSDP2 HSDP
on dp_replicate x dp_shard does the gradient collectives, asynchronously; ``steps`` only).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def busy(seconds: float) -> None:
    """The straggler's extra work: Python holding a core."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def slow_loop(config: dict, mesh=None) -> int:
    """Train until ``steps`` or ``duration_s`` or ``stop_file``; returns the steps done."""
    import ray_mesh

    mesh = mesh or ray_mesh.get_mesh()
    torch.manual_seed(0)
    width = int(config.get("width", 256))
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width))
    groups = [mesh.get_group(d) for d in ("dp_shard", "dp_replicate")
              if mesh.mesh_dim_names and d in mesh.mesh_dim_names and mesh[d].size() > 1]
    if config.get("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["dp_replicate", "dp_shard"])
        fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
        groups = []  # FSDP2 reduces the gradients itself
    slow = config.get("slow_rank")
    busy_s = float(config.get("busy_s", 0.05))
    end = time.monotonic() + float(config.get("duration_s", 1e9))
    stop_file = config.get("stop_file")
    step, stop = 0, False
    # The stop decision rides on the gradient all-reduce (one more float): all ranks stop
    # after the same step, with no extra collective on the path being measured.
    while not stop:
        done = step + 1 >= int(config.get("steps", 10**9)) or time.monotonic() > end or (
            stop_file and step % 10 == 0 and os.path.exists(stop_file))
        x = torch.randn(32, width)
        loss = model(x).square().mean()
        loss.backward()
        if slow is not None and dist.get_rank() == int(slow):
            busy(busy_s)
        if groups:
            flat = torch.cat([*(p.grad.flatten() for p in model.parameters()),
                              torch.tensor([float(bool(done))])])
            for g in groups:
                dist.all_reduce(flat, group=g)
            stop = bool(flat[-1] > 0)
        else:
            stop = step + 1 >= int(config["steps"])
        for p in model.parameters():
            p.grad = None
        step += 1
    return step


def main() -> int:
    """torchrun entry: ``torchrun --nproc-per-node 4 harness/slow_train.py CONFIG_JSON``.

    Each rank writes ``rank_<r>.json``: its node, coordinates and its wait windows.
    """
    import ray_mesh
    from ray_mesh.core import bootstrap
    from ray_mesh.observability import hang, waits

    config = json.loads(sys.argv[1])
    mesh = ray_mesh.init_mesh({"dp_replicate": 2, "dp_shard": 2})
    windows: list[dict] = []
    sampler = waits.WaitSampler(hang.mesh_groups(mesh), windows.append,
                                window_s=float(config.get("window_s", 3.0))).start()
    sampler.watch_thread()
    steps = slow_loop(config, mesh)
    sampler.stop()
    state = bootstrap.get_state()
    out = {"rank": state.rank, "node": config.get("node", "local"), "steps": steps,
           "coord": {k: int(v) for k, v in state.coordinate.items()}, "windows": windows}
    with open(os.path.join(config["out_dir"], f"rank_{state.rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    ray_mesh.shutdown_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
