"""torchrun worker of benchmarks/slow.py: a toy HSDP step (dp_replicate=2 x dp_shard=2) with
the wait sampler off and on, in alternating windows, plus the sampler's cost per sample."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

import ray_mesh
from ray_mesh.observability import hang, waits


def main() -> None:
    out, rounds, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.manual_seed(0)
    mesh = ray_mesh.init_mesh({"dp_replicate": 2, "dp_shard": 2})
    groups = [mesh.get_group("dp_shard"), mesh.get_group("dp_replicate")]
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    x = torch.randn(64, 256)

    def step() -> None:
        model(x).square().mean().backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        for g in groups:
            dist.all_reduce(flat, group=g)
        for p in model.parameters():
            p.grad = None

    def window() -> list[float]:
        dist.barrier()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        return times

    for _ in range(5):
        step()
    plain: list[float] = []
    sampled: list[float] = []
    ratios = []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        med = {}
        for on in order:
            if on:
                sampler = waits.WaitSampler(hang.mesh_groups(mesh)).start()
                sampler.watch_thread()
                times = window()
                sampler.stop()
                sampled += times
            else:
                times = window()
                plain += times
            med[on] = statistics.median(times)
        ratios.append(med[True] / med[False])
    # The sampler's own work per sample, with a second thread (waiting, outside torch).
    sampler = waits.WaitSampler(hang.mesh_groups(mesh))
    blocker = threading.Event()

    def blocked() -> None:
        blocker.wait(5)

    t = threading.Thread(target=blocked)
    t.start()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.sample()
    idle = (time.perf_counter() - t0) / n
    blocker.set()
    t.join()
    # The same with this rank's main thread blocked in a collective (rank 3 comes late):
    # every sample then reads the all_reduce frame's locals to name the group.
    sampler.watch_thread()
    inside: dict = {}

    def measure_inside() -> None:
        time.sleep(0.5)
        t0 = time.perf_counter()
        for _ in range(500):
            sampler.sample()
        inside["s"] = (time.perf_counter() - t0) / 500
        inside["label"] = sampler.classify(sys._current_frames()[sampler.thread_id])

    if dist.get_rank() != 3:
        m = threading.Thread(target=measure_inside)
        m.start()
    else:
        time.sleep(3.0)
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() != 3:
        m.join()
    dist.barrier()
    if dist.get_rank() == 0:
        step_s = statistics.median(plain)
        with open(out, "w") as f:
            json.dump({"step_plain_s": step_s, "step_sampled_s": statistics.median(sampled),
                       "sampled_over_plain_median_of_rounds": statistics.median(ratios),
                       "round_ratios": ratios, "rounds": rounds, "steps_per_window": steps,
                       "sample_cost_s": max(idle, inside["s"]),
                       "sample_cost_idle_thread_s": idle,
                       "sample_cost_in_collective_s": inside["s"],
                       "in_collective_classified_as": inside["label"],
                       "sample_interval_s": waits.DEFAULT_INTERVAL_S,
                       "sampler_share_of_time": max(idle, inside["s"])
                       / waits.DEFAULT_INTERVAL_S}, f)
    ray_mesh.shutdown_mesh()


if __name__ == "__main__":
    main()
