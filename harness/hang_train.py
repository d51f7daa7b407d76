"""A train loop in which one rank skips a dp all_reduce and sleeps: the hang the watch explains.

Shared by the torchrun test (tests/dist/test_hang_torchrun.py), the Ray test
(tests/ray/test_hang_ray.py) and benchmarks/hang.py. Every step does a plain
``dist.all_reduce`` on the tp group (seen only through torch's per-group counter) and a
``ray_mesh.observability.hang.all_reduce`` on dp (named by the helper). At ``skip_step``
the rank ``skip_rank`` skips the dp one, writes the time the hang started, and sleeps.
``pg_timeout_s`` (optional): the watched groups' process-group timeout when smaller than
``hang_timeout_s`` + ``hang.END_GRACE_S`` (how soon the waiting ranks' collectives end).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import ray_mesh
from ray_mesh.observability import hang
from ray_mesh.observability.owner import watch_mesh


def stuck_in_user_code(seconds: float) -> None:
    """Where the skipping rank sits; the report must show this frame."""
    time.sleep(seconds)


def hang_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    rank = dist.get_rank()
    tp = mesh.get_group("tp")
    for step in range(config.get("steps", 50)):
        t = torch.ones(8)
        dist.all_reduce(t, group=tp)
        if step == config["skip_step"] and rank == config["skip_rank"]:
            with open(os.path.join(config["out_dir"], "hang_start.json"), "w") as f:
                json.dump({"t": time.time(), "rank": rank}, f)
            stuck_in_user_code(config.get("sleep_s", 300))
            continue
        hang.all_reduce(t, "dp")
        time.sleep(0.01)


def _note_report(out_dir: str) -> None:
    """Record when this rank first held the report (the detection time of the benchmark)."""
    import threading

    def wait() -> None:
        watch = hang.current()
        if watch is not None and watch.report_ready.wait(600):
            path = os.path.join(out_dir, f"report_{dist.get_rank()}.json")
            with open(path, "w") as f:
                json.dump({"t": time.time(), "report": watch.report}, f)

    threading.Thread(target=wait, daemon=True).start()


def main() -> int:
    """torchrun entry: ``torchrun --nproc-per-node 4 harness/hang_train.py CONFIG_JSON``."""
    config = json.loads(sys.argv[1])
    mesh = ray_mesh.init_mesh({"dp_shard": 2, "tp": 2})
    try:
        with watch_mesh(mesh, config["hang_timeout_s"],
                        pg_timeout_s=config.get("pg_timeout_s")):
            _note_report(config["out_dir"])
            hang_loop(config)
    except hang.CollectiveHangError as exc:
        with open(os.path.join(config["out_dir"], f"error_{dist.get_rank()}.txt"), "w") as f:
            f.write(str(exc))
        raise
    ray_mesh.shutdown_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
