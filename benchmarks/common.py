"""Shared pieces of the benchmarks: medians, process-group counts, the torchrun launcher.

Ray-free on purpose: the same helpers run inside Ray Train workers, under torchrun, and on
the driver. Figures are plain dicts of numbers so that ``run.py`` can dump them to JSON
unchanged.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "_torchrun_worker.py"


def write_result(path: str, obj: dict) -> None:
    """Rank 0 of a Ray Train run hands its figures back through a file.

    Ray Train V2's ``Result.metrics`` only keeps metrics reported with a checkpoint, and the
    benchmarks run on one machine (the netns cluster shares the filesystem too).
    """
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj))
    os.replace(tmp, path)


def forked(target, args: list[tuple], cores: float | None, name: str, timeout_s: float
           ) -> tuple[dict, float]:
    """Fork one process per entry of ``args`` running ``target(*entry, queue)``, all of them
    in one new cgroup capped at ``cores`` (None: the machine's CPUs); the first thing put on
    the queue, and the 1-minute load when they started."""
    import multiprocessing as mp

    from harness.netns.cpu import make_cgroup, remove_cgroup

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    load0 = os.getloadavg()[0]
    group = make_cgroup(name, cores) if cores is not None else None
    procs = [ctx.Process(target=target, args=(*a, out)) for a in args]
    for p in procs:
        p.start()
        if group is not None:
            (group / "cgroup.procs").write_text(str(p.pid))
    try:
        got = out.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(60)
        if group is not None:
            remove_cgroup(group)
    return got, load0


def two_sides(got: dict, before: str, after: str, rounds: int, load0: float) -> dict:
    """The figures of one setting of a side-by-side benchmark from each side's times in
    ``got``: the median of each (``<side>_s``), their ratio ``before / after``, the times
    themselves and the 1-minute load at the start and now."""
    med = {k: statistics.median(got[k]) for k in (before, after)}
    return {f"{before}_s": med[before], f"{after}_s": med[after],
            "ratio": med[before] / med[after], "rounds": rounds,
            "times_s": {k: got[k] for k in (before, after)},
            "loadavg_1m": [load0, os.getloadavg()[0]]}


def side_by_side(key: str, out: str, statistic: str, measure, cores: float,
                 describe) -> dict:
    """A side-by-side benchmark of two sides in two settings: once the machine is quiet (at
    most 120 s), ``measure(None)`` (the machine's CPUs) then ``measure(cores)`` (a cgroup),
    each a dict of :func:`two_sides`' figures; written under ``results.json[key]`` at
    ``out`` (the other keys kept) with the statistic and the start, and a line printed per
    setting (``describe(setting)`` says what was measured)."""
    from benchmarks.user_job_figures import wait_quiet

    wait_quiet(120)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = {"statistic": statistic, "started": started,
              "settings": [measure(None), measure(cores)]}
    path = Path(out)
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = result
    path.write_text(json.dumps(results, indent=1))
    for s in result["settings"]:
        a, b = s["times_s"]
        print(f"cores {s['cores'] or 'all'}: {describe(s)}, {a} {s[f'{a}_s'] * 1e3:.1f} ms, "
              f"{b} {s[f'{b}_s'] * 1e3:.1f} ms ({s['ratio']:.1f}x), load "
              f"{s['loadavg_1m'][0]:.1f}-{s['loadavg_1m'][1]:.1f}")
    return result


def fit_netns_workers(train, args: dict, mesh_config, tag: str) -> None:
    """One fit of ``train`` on the virtual cluster's 4 workers (2 per node: the ``slot``
    resource), run from a driver inside the head namespace; figures come back by file."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    TorchTrainer(
        train, train_loop_config=args,
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 0.5,
                                                                          "slot": 1}),
        torch_config=mesh_config,
        run_config=RunConfig(name=f"{tag}_{time.time_ns()}", storage_path=args["storage"]),
    ).fit()


def run_head_driver(cluster, module: str, args: dict, timeout_s: float, what: str) -> None:
    """Run ``python -m <module> <args as JSON>`` in the netns cluster's head namespace as a
    Ray driver of that cluster; raise RuntimeError naming ``what`` with its output tails."""
    env = cluster.node_env(cluster.head)
    env.update(RAY_ADDRESS=cluster.address, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.run([*cluster.head.exec_prefix(), sys.executable, "-m", module,
                           json.dumps(args)],
                          capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=str(REPO))
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                           f"{proc.stderr[-4000:]}")


def result_path(tag: str) -> str:
    return os.path.join(tempfile.mkdtemp(prefix=f"rmbench_{tag}_"), "result.json")


def read_result(path: str) -> dict:
    return json.loads(Path(path).read_text())


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_stats() -> dict[str, int]:
    """What this rank's process groups cost: calls made, groups held, real vs fake.

    ``group_count`` is torch's own counter of ``new_group`` calls on this rank (members and
    non-members alike: DeviceMesh calls it once per subgroup on every rank on CPU/gloo);
    ``pg_map`` holds the groups this rank is a member of, by backend. Threads are the OS
    threads of the process (gloo starts worker threads per real group).
    """
    from torch.distributed.distributed_c10d import _world

    by_backend: dict[str, int] = {}
    for backend, _store in _world.pg_map.values():
        by_backend[str(backend)] = by_backend.get(str(backend), 0) + 1
    return {
        "new_group_calls": int(_world.group_count),
        "groups_held": len(_world.pg_map),
        "real_groups_held": sum(v for k, v in by_backend.items() if k != "fake"),
        "fake_groups_held": by_backend.get("fake", 0),
        "threads": _thread_count(),
    }


def _thread_count() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def run_torchrun(nproc: int, mode: str, args: dict, timeout_s: float = 300.0) -> dict:
    """Launch ``_torchrun_worker.py MODE`` on ``nproc`` local ranks; rank 0's JSON result.

    ``launch_wall`` is the driver's clock from just before the launch (``time.time()``), so
    workers can report their own ``time.time()`` against it (same machine, same clock).
    """
    with tempfile.TemporaryDirectory(prefix="rmbench_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               str(WORKER), mode, str(out), json.dumps(args)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per rank, as Ray does per worker
        launch = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env,
                              cwd=str(REPO))
        done = time.time()
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"torchrun {mode} x{nproc} failed (rc {proc.returncode}):\n"
                               f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
    result["launch_wall"] = launch
    result["process_wall_s"] = done - launch
    return result
