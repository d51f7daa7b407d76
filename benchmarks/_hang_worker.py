"""torchrun worker of benchmarks/hang.py: a toy dp_shard=2 x tp=2 step with the hang watch
off and on, in alternating windows, plus the per-call cost of a watched all_reduce."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import ray_mesh
from ray_mesh.observability import hang
from ray_mesh.observability.owner import watch_mesh


def main() -> None:
    out, rounds, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    mesh = ray_mesh.init_mesh({"dp_shard": 2, "tp": 2})
    tp, dp = mesh.get_group("tp"), mesh.get_group("dp")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    x = torch.randn(64, 256)

    def step(watched: bool) -> None:
        loss = model(x).square().mean()
        loss.backward()
        act = torch.ones(1024)
        dist.all_reduce(act, group=tp)  # unwrapped: seen through torch's counter only
        for p in model.parameters():
            if watched:
                hang.all_reduce(p.grad, "dp")
            else:
                dist.all_reduce(p.grad, group=dp)
            p.grad = None

    def window(watched: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(watched)
        return (time.perf_counter() - t0) / steps

    for _ in range(3):
        step(False)
    plain, watched = [], []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for on in order:
            if on:
                with watch_mesh(mesh, 60.0):  # the owner hang.all_reduce finds
                    watched.append(window(True))
            else:
                plain.append(window(False))
    # Per call: the watched() context around a 1-element all_reduce vs the bare call.
    t = torch.ones(1)
    running = contextlib.ExitStack()
    running.enter_context(watch_mesh(mesh, 60.0))
    per_call = {}
    for name, fn in (("plain", lambda: dist.all_reduce(t, group=dp)),
                     ("watched", lambda: hang.all_reduce(t, "dp"))):
        samples = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            samples.append((time.perf_counter() - t0) / 200)
        per_call[name] = statistics.median(samples)
    t0 = time.perf_counter()
    for _ in range(100000):
        with hang.watched("dp", "all_reduce"):
            pass
    wrapper_s = (time.perf_counter() - t0) / 100000
    # The watchdog's own work, once per poll (1 s): counters, heartbeat, store checks.
    watch = hang.current()
    t0 = time.perf_counter()
    for _ in range(50):
        watch._tick()
    tick_s = (time.perf_counter() - t0) / 50
    running.close()
    if dist.get_rank() == 0:
        ratios = [w / p for w, p in zip(watched, plain, strict=True)]
        with open(out, "w") as f:
            json.dump({"step_plain_s": statistics.median(plain),
                       "step_watched_s": statistics.median(watched),
                       "watched_over_plain_median_of_pairs": statistics.median(ratios),
                       "rounds": rounds, "steps_per_window": steps,
                       "allreduce_1elem_plain_s": per_call["plain"],
                       "allreduce_1elem_watched_s": per_call["watched"],
                       "watched_context_s": wrapper_s, "watchdog_tick_s": tick_s,
                       "watchdog_poll_s": watch.poll_s}, f)
    ray_mesh.shutdown_mesh()


if __name__ == "__main__":
    main()
