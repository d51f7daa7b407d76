"""The torchrun side of the benchmarks: ``torchrun ... _torchrun_worker.py MODE OUT ARGS``.

Modes:
  ready      init_process_group + init_device_mesh (only the dims the job needs), as a
             torchrun user writes it; reports the wall clock when every rank is ready.
  meshbuild  times building meshes on an existing process group: only the needed dims,
             ray_mesh's ``build_device_mesh``, and every dim as a real group (the old
             ray_mesh behaviour), with process-group counts for each.
  paired     ray_mesh.init_mesh + a workload's windows, taking turns with other launchers
             (``paired.py``).
Rank 0 writes one JSON object to OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from benchmarks import workloads  # noqa: E402
from benchmarks.common import pg_stats  # noqa: E402


def _ready(args: dict) -> dict:
    t0 = time.time()
    dist.init_process_group("gloo")
    workloads.plain_hsdp_mesh(dist.get_world_size())
    now = time.time()
    return workloads.ready_figures(now, now - t0)


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def _meshbuild(args: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from ray_mesh.core.bootstrap import build_device_mesh
    from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS, MeshSpec
    from ray_mesh.private_apis import flatten_mesh

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    spec = MeshSpec(dp_replicate=2, dp_shard=-1).resolve(world)

    def all_real():
        mesh = init_device_mesh("cpu", tuple(spec.shape), mesh_dim_names=DIM_NAMES)
        for flat, parts in FLATTENED_DIMS.items():
            flatten_mesh(mesh[parts], flat)

    variants = {
        "needed_dims_only": lambda: workloads.plain_hsdp_mesh(world),
        "ray_mesh": lambda: build_device_mesh(spec, "cpu"),
        "all_dims_real": all_real,
    }
    out: dict = {"world_size": world}
    for rep in range(args.get("repeats", 3)):
        for name, build in variants.items():
            dist.barrier()
            before = pg_stats()
            t0 = time.perf_counter()
            build()
            dist.barrier()
            seconds = time.perf_counter() - t0
            cost = _delta(before, pg_stats())
            entry = out.setdefault(name, {"seconds": [], **cost})
            entry["seconds"].append(seconds)
            if rep == 0:
                entry.update(cost)
    return out


def _paired(args: dict) -> dict:
    from benchmarks import paired

    return paired.run_contender(args)


def main() -> None:
    mode, out, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    result = {"ready": _ready, "meshbuild": _meshbuild, "paired": _paired}[mode](args)
    if dist.get_rank() == 0:
        result["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
