"""What every rank runs in the benchmarks, identical under Ray Train and under torchrun.

Ray-free (torch only): the Ray side wraps these in train functions (``bringup.py``,
``steps.py``), torchrun runs them through ``_torchrun_worker.py``. Keeping one copy is what
makes a ray_mesh-vs-torchrun ratio mean "the launcher's cost" and nothing else.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.common import pg_stats

HSDP_DIMS = ("dp_replicate", "dp_shard")


def plain_hsdp_mesh(world_size: int) -> DeviceMesh:
    """What a plain TorchTrainer user writes: only the dims the job needs."""
    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=HSDP_DIMS)


def ready_figures(t_ready: float, t_build: float | None = None) -> dict:
    """Gather every rank's "mesh ready" wall clock; every rank gets the same dict back."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (t_ready, t_build))
    out = {
        "ready_wall_max": max(t for t, _ in everyone),
        "ready_wall_min": min(t for t, _ in everyone),
        **{f"rank0_{k}": v for k, v in pg_stats().items()},
    }
    builds = [b for _, b in everyone if b is not None]
    if builds:
        out["mesh_build_s_max"] = max(builds)
    return out


# ----------------------------------------------------------------------------- step timing
def _dp_rank(mesh: DeviceMesh) -> int:
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + \
        mesh["dp_shard"].get_local_rank()


def hsdp_example_step(mesh: DeviceMesh, device: torch.device, batch: int
                      ) -> Callable[[int], torch.Tensor]:
    """One training step of ``examples/hsdp.py``: its model, data and HSDP wrapping.

    Uses the example's own ``build``/``train_step`` when it has them, else (older example)
    its ``ToyModel`` with ``fully_shard`` on ``mesh["dp_replicate", "dp_shard"]``.
    """
    from examples import hsdp

    dp_rank = _dp_rank(mesh)
    if hasattr(hsdp, "build") and hasattr(hsdp, "train_step"):
        model = hsdp.build(mesh, {"batch_size": batch})
        optim = torch.optim.AdamW(model.parameters(), lr=0.05)

        def step(i: int) -> torch.Tensor:
            x, y = hsdp.synthetic_batch(i, dp_rank, batch, device)
            return hsdp.train_step(model, optim, x, y, mesh)

        return step

    torch.manual_seed(0)
    model = hsdp.ToyModel().to(device)
    fully_shard(model, mesh=mesh[HSDP_DIMS])
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)

    def old_step(i: int) -> torch.Tensor:
        x, y = hsdp.synthetic_batch(i, dp_rank, batch, device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return old_step


def tp_pp_mlp_step(mesh: DeviceMesh, device: torch.device, batch: int
                   ) -> Callable[[int], torch.Tensor]:
    """One training step of ``examples/tp_pp_mlp.py`` (2 pipeline stages x 2 TP ranks)."""
    from examples import tp_pp_mlp

    cfg = {"batch_size": batch}
    pipe = tp_pp_mlp.build(mesh, cfg)
    optim = torch.optim.AdamW(pipe.parameters(), lr=0.01)

    def step(i: int) -> torch.Tensor:
        return tp_pp_mlp.train_step(pipe, optim, *tp_pp_mlp.batch(i, cfg), mesh)

    return step


WORKLOADS: dict[str, tuple[dict, Callable]] = {
    "hsdp": ({"dp_replicate": 2, "dp_shard": -1}, hsdp_example_step),
    "tp_pp_mlp": ({"pp": 2, "dp_replicate": 1, "dp_shard": -1, "tp": 2}, tp_pp_mlp_step),
}
"""name -> (mesh spec, step factory); both run on 4 ranks."""


def workload_available(name: str) -> str | None:
    """None when the example can be imported, else why not."""
    try:
        __import__(f"examples.{name}")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not run"
        return f"examples/{name}.py not importable: {exc}"
    return None


def time_windows(step: Callable[[int], torch.Tensor], *, warmup: int, windows: int,
                 steps_per_window: int, meter_factory: Callable | None = None,
                 metered_first: bool = False) -> dict:
    """Seconds per step, per window, after ``warmup`` steps.

    Windows are bracketed by barriers so every rank times the same steps. With
    ``meter_factory`` (a ``ReportRecorder``), windows alternate plain / with every step's loss
    handed to ``observe`` (report bookkeeping side by side, same process, same warm caches),
    plain first unless ``metered_first``. A flush due at a step runs inside its window.
    """
    i = 0
    for _ in range(warmup):
        step(i)
        i += 1
    plain: list[float] = []
    metered: list[float] = []
    meter = meter_factory() if meter_factory else None
    for w in range(windows * (2 if meter else 1)):
        use_meter = meter is not None and w % 2 == (0 if metered_first else 1)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps_per_window):
            if use_meter:
                meter.observe({"step": i, "loss": step(i)})
            else:
                step(i)
            i += 1
        dist.barrier()
        per_step = (time.perf_counter() - t0) / steps_per_window
        (metered if use_meter else plain).append(per_step)
    if meter is not None:
        meter.flush()
    # Rank 0 speaks for all: the barriers make every rank's windows the same length.
    return {"step_s_windows": plain, "metered_step_s_windows": metered,
            "torch_threads": torch.get_num_threads()}


def paired_windows(step: Callable[[int], torch.Tensor], baton, *, warmup: int,
                   steps_per_window: int) -> dict:
    """Seconds per step in this contender's turns of a ``baton.Baton`` schedule.

    Per window: wall seconds per step (rank 0, between barriers, so every rank ran the same
    steps) and CPU seconds per step summed over the ranks (``time.process_time``: every
    thread of each rank's process, gloo's and the launcher's included, so a launcher that
    keeps threads busy beside the step shows up here even when wall time hides it).
    """
    rank0 = dist.get_rank() == 0
    i = 0
    for _ in range(warmup):
        step(i)
        i += 1
    if rank0:
        baton.ready()
    wall: list[float] = []
    cpu: list[float] = []
    for turn in baton.turns:
        if rank0:
            baton.wait_turn(turn)
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps_per_window):
            step(i)
            i += 1
        dist.barrier()
        t1, c1 = time.perf_counter(), time.process_time()
        if rank0:
            baton.pass_on(turn)
        wall.append((t1 - t0) / steps_per_window)
        cpu.append((c1 - c0) / steps_per_window)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, cpu)
    return {"turns": baton.turns, "step_s_windows": wall,
            "cpu_s_windows": [sum(per_rank) for per_rank in zip(*everyone, strict=True)],
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


# ----------------------------------------------------------------------------- cross-node
def mlp(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def param_count(width: int, layers: int) -> int:
    return layers * (width * width + width)


def read_counters(iface: str) -> dict[str, int]:
    """This network namespace's interface counters (sysfs is per namespace)."""
    base = f"/sys/class/net/{iface}/statistics"
    out = {}
    for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
        with open(f"{base}/{key}") as f:
            out[key] = int(f.read())
    return out


def crossnode_bytes(mesh: DeviceMesh, dims: tuple[str, ...], cfg: dict, local_rank: int
                    ) -> dict:
    """Interface counters around ``steps`` FSDP2 steps on ``mesh[dims]``, minus idle traffic.

    Local rank 0 of each node reads its namespace's tailnet counters; every byte that
    crosses nodes leaves exactly one node's tailnet interface, so the sum of tx deltas over
    nodes is the cross-node traffic. An idle window of the same length (all ranks asleep)
    measures Ray's own background chatter, which is subtracted.
    """
    width, layers, steps = cfg["width"], cfg["layers"], cfg["steps"]
    iface = cfg.get("iface", "tailscale0")
    torch.manual_seed(0)
    model = mlp(width, layers)
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    for layer in model:
        fully_shard(layer, mesh=sub)
    fully_shard(model, mesh=sub)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(cfg.get("batch", 8), width, generator=g)

    def step() -> None:
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    for _ in range(cfg.get("warmup", 2)):
        step()

    def counters() -> dict[str, int] | None:
        dist.barrier()
        return read_counters(iface) if local_rank == 0 else None

    c0 = counters()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    c1 = counters()
    busy_s = time.perf_counter() - t0
    time.sleep(busy_s)
    c2 = counters()
    mine = None
    if local_rank == 0:
        mine = {k: (c1[k] - c0[k], c2[k] - c1[k]) for k in c0}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    nodes = [m for m in everyone if m is not None]
    total = {k: sum(m[k][0] for m in nodes) for k in nodes[0]}
    idle = {k: sum(m[k][1] for m in nodes) for k in nodes[0]}
    return {"steps": steps, "busy_s": busy_s, "nodes_counted": len(nodes),
            "train": total, "idle": idle, "params": param_count(width, layers),
            "per_node": nodes}
