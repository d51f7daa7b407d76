"""Run by ``tests/dist/test_observability_owner.py`` under ``torchrun --nproc-per-node 2``.

One process, one mesh, the worker's observability started, stopped and started again: each
start builds a fresh recorder, hang watch and wait sampler (nothing inherited from the run
before), each stop ends their threads and forgets the owner, and a start while another owner
runs stops that one first. Rank 0 prints ``PASS <name>`` per check and ``ALL_DONE``.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

import ray_mesh
from ray_mesh.observability import active, hang
from ray_mesh.observability.owner import Observability, ObservabilitySettings, watch_mesh

THREADS = ("ray_mesh-hang-watch", "ray_mesh-wait-sampler")
SETTINGS = ObservabilitySettings(ray_mesh.MeshOptions(hang_timeout_s=30.0, wait_sample_s=0.02),
                                 export=False, total_steps=3)


def _ours() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name in THREADS)


def _pass(name: str) -> None:
    if dist.get_rank() == 0:
        print(f"PASS {name}", flush=True)


def _one_run(mesh, round_: int, seen: list) -> None:
    obs = Observability(SETTINGS).start(mesh)
    assert active.current() is obs and hang.current() is obs.watch, round_
    assert _ours() == sorted(THREADS), _ours()
    assert all(obs is not earlier and obs.recorder is not earlier.recorder for earlier in seen)
    assert obs.recorder.calls == 0 and obs.recorder.first_t is None  # nothing inherited
    t = torch.ones(1)
    with hang.watched("dp_shard", "my_op"):
        hang.all_reduce(t, "dp_shard")  # through the running owner's watch
    assert t.item() == 2.0
    obs.recorder.observe({"step": 1, "loss": 1.0})
    assert obs.recorder.calls == 1
    obs.stop()
    assert active.current() is None and hang.current() is None
    assert _ours() == [], _ours()
    obs.stop()  # twice is harmless
    seen.append(obs)


def main() -> None:
    mesh = ray_mesh.init_mesh(ray_mesh.MeshSpec(dp_shard=-1), backend="gloo")
    assert _ours() == [] and active.current() is None
    seen: list = []
    for round_ in (1, 2, 3):
        _one_run(mesh, round_, seen)
    _pass("start_stop_restart")

    first = Observability(SETTINGS).start(mesh)
    second = Observability(SETTINGS).start(mesh)  # a run that did not stop its owner
    assert not first.running and first.watch is None and active.current() is second
    assert _ours() == sorted(THREADS), _ours()  # one set of threads, not two
    second.stop()
    assert _ours() == [] and active.current() is None
    _pass("a_new_start_stops_the_owner_left_running")

    with watch_mesh(mesh, 30.0) as watch:
        assert hang.current() is watch and _ours() == ["ray_mesh-hang-watch"]
    assert hang.current() is None and _ours() == []
    _pass("watch_mesh_under_torchrun")

    rank = dist.get_rank()
    ray_mesh.shutdown_mesh()
    if rank == 0:
        print("ALL_DONE", flush=True)


if __name__ == "__main__":
    main()
