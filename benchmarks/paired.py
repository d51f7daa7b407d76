"""Step overhead, paired: ray_mesh, plain Ray Train and torchrun alive at once, taking turns.

Three contenders run the same workload (an example's ``build``/``train_step``, same mesh,
same data) on 4 ranks each:

* ``torchrun``: ``torchrun`` + ``ray_mesh.init_mesh`` (the Ray-free core);
* ``ray_plain``: ``TorchTrainer`` with Ray's own ``TorchConfig``; the train function calls
  ``ray_mesh.init_mesh`` on the process group Ray made (so the mesh is the same object);
* ``ray_mesh``: ``TorchTrainer(torch_config=MeshConfig(...))``;
* ``ray_plain_nice0`` (ablation): ``ray_plain`` whose train function first resets its
  process to niceness 0 with ``ray_mesh.core.priority.set_niceness`` (what ``MeshConfig``
  does). Ray starts workers at niceness 15, torchrun's ranks and ray_mesh's run at 0, so
  ``ray_mesh / ray_plain`` mixes two things: ``ray_mesh / ray_plain_nice0`` is ray_mesh's
  own cost at equal niceness, ``ray_plain_nice0 / ray_plain`` the niceness reset alone;
* ``ray_mesh_nice15`` (ablation, not in the default set): ``MeshConfig(worker_niceness=None)``,
  ray_mesh with Ray's worker niceness left at 15.

They share the machine (12 processes, 4 busy at a time) and take turns through
``baton.Baton``: one timing window each per round, in a rotating order. ray_mesh / torchrun
is the issue's figure; ray_mesh / ray_plain is what ray_mesh itself adds to Ray Train, and
ray_plain / torchrun is what running inside a Ray Train worker costs.

The Ray contenders are two driver subprocesses (``python benchmarks/paired.py ray ...``)
joined to the benchmark's Ray instance, because two ``fit()`` calls must run at once.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, WORKER, free_port, median  # noqa: E402

CONTENDERS = ["torchrun", "ray_plain", "ray_plain_nice0", "ray_mesh"]
KNOWN_CONTENDERS = (*CONTENDERS, "ray_mesh_nice15")
RATIO_PAIRS = (("ray_mesh", "torchrun"), ("ray_mesh", "ray_plain"), ("ray_plain", "torchrun"),
               ("ray_mesh", "ray_plain_nice0"), ("ray_plain_nice0", "ray_plain"),
               ("ray_plain_nice0", "torchrun"),
               ("ray_mesh_nice15", "torchrun"), ("ray_mesh", "ray_mesh_nice15"))
"""(a, b) for every a / b figure, wherever both launchers ran (run.py's table, pool.py)."""


def run_contender(args: dict) -> dict:
    """In every rank of any launcher: the mesh, the workload, the turns. Ray-free."""
    import ray_mesh
    from benchmarks import workloads
    from benchmarks.baton import Baton

    spec, factory = workloads.WORKLOADS[args["workload"]]
    if not ray_mesh.is_initialized():  # torchrun and ray_plain; MeshConfig built it already
        ray_mesh.init_mesh(ray_mesh.MeshSpec(**spec))
    state = ray_mesh.get_state()
    step = factory(state.mesh, state.device, args["batch"])
    baton = Baton(args["baton_dir"], args["name"], args["contenders"], args["schedule"],
                  timeout_s=args["timeout_s"])
    return workloads.paired_windows(step, baton, warmup=args["warmup"],
                                    steps_per_window=args["steps_per_window"])


def _train(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    from benchmarks.common import write_result

    if config["name"] == "ray_plain_nice0":  # the ablation: MeshConfig's niceness, by hand
        from ray_mesh.core import priority

        res = priority.set_niceness(0)
        if res.error:
            raise RuntimeError(f"ray_plain_nice0 needs niceness 0: {res.error}")
    out = run_contender(config)
    if dist.get_rank() == 0:
        write_result(config["out"], out)
    ray.train.report({"done": 1})


def _ray_driver(name: str, out: str, args: dict) -> None:
    """Subprocess: join the benchmark's Ray instance and fit one Ray contender."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from benchmarks.workloads import WORKLOADS
    from ray_mesh import MeshConfig, MeshSpec

    ray.init(address=args["ray_address"], log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    mesh = MeshSpec(**WORKLOADS[args["workload"]][0])
    torch_config = {
        "ray_mesh": lambda: MeshConfig(mesh=mesh),
        "ray_mesh_nice15": lambda: MeshConfig(mesh=mesh, worker_niceness=None),
        "ray_plain": lambda: TorchConfig(backend="gloo"),
        "ray_plain_nice0": lambda: TorchConfig(backend="gloo"),
    }[name]()
    TorchTrainer(
        _train,
        train_loop_config={**args, "name": name, "out": out},
        scaling_config=ScalingConfig(num_workers=args["workers"],
                                     resources_per_worker={"CPU": 1}),
        torch_config=torch_config,
        run_config=RunConfig(name=f"paired_{name}_{time.time_ns()}",
                             storage_path=args["storage"]),
    ).fit()


def _spawn(name: str, tmp: Path, args: dict) -> tuple[subprocess.Popen, Path, Path]:
    out, log = tmp / f"{name}.json", tmp / f"{name}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if name == "torchrun":
        env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per rank, as Ray does per worker
        cmd = [sys.executable, "-m", "torch.distributed.run",
               f"--nproc-per-node={args['workers']}", "--nnodes=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}",
               str(WORKER), "paired", str(out), json.dumps({**args, "name": name})]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "ray", name, str(out),
               json.dumps(args)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=str(REPO))
    return proc, out, log


def paired_ratios(a: list[float], b: list[float]) -> dict:
    """Round-by-round ratios a[k] / b[k]: median, quartiles, and the ratio of medians."""
    ratios = sorted(x / y for x, y in zip(a, b, strict=True) if y)
    if not ratios:
        return {}
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"median_paired": statistics.median(ratios), "q1": q[0], "q3": q[2],
            "geomean_paired": statistics.geometric_mean(ratios),
            "ratio_of_medians": statistics.median(a) / statistics.median(b),
            "rounds": len(ratios)}


def measure(workload: str, cfg: dict, storage: str, ray_address: str,
            contenders: list[str] | None = None) -> dict:
    """Run the contenders side by side on ``workload``; figures and every window."""
    contenders = contenders or CONTENDERS
    unknown = set(contenders) - set(KNOWN_CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contenders {sorted(unknown)}; known: {KNOWN_CONTENDERS}")
    from benchmarks.baton import rotating_schedule

    with tempfile.TemporaryDirectory(prefix="rmbench_paired_") as tmpdir:
        tmp = Path(tmpdir)
        args = {**cfg, "workload": workload, "contenders": contenders,
                "schedule": rotating_schedule(contenders, cfg["rounds"]),
                "baton_dir": str(tmp), "ray_address": ray_address, "storage": storage}
        procs = {name: _spawn(name, tmp, args) for name in contenders}
        deadline = time.monotonic() + cfg["timeout_s"] + 300
        failed = {}
        for name, (proc, _out, log) in procs.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "timeout"
            if rc != 0:
                failed[name] = f"rc {rc}: {log.read_text()[-3000:]}"
        if failed:
            for proc, _o, _l in procs.values():
                if proc.poll() is None:
                    proc.kill()
            raise RuntimeError(f"paired steps {workload}: contenders failed: {failed}")
        runs = {name: json.loads(out.read_text()) for name, (_p, out, _l) in procs.items()}

    wall = {n: runs[n]["step_s_windows"] for n in contenders}
    cpu = {n: runs[n]["cpu_s_windows"] for n in contenders}
    out: dict = {"workload": f"examples/{workload}.py", "args": {
        k: v for k, v in args.items() if k not in ("schedule", "ray_address", "baton_dir")},
        "runs": runs,
        "statistic": "X_step_s / X_cpu_s: median over X's windows; a_vs_b: median_paired = "
                     "median of the per-round ratios a[k] / b[k], q1 / q3 their quartiles, "
                     "rounds = n"}
    for n in contenders:
        out[f"{n}_step_s"] = median(wall[n])
        out[f"{n}_cpu_s"] = median(cpu[n])
    for a, b in RATIO_PAIRS:
        if a in wall and b in wall:
            out[f"{a}_vs_{b}"] = paired_ratios(wall[a], wall[b])
            out[f"{a}_vs_{b}_cpu"] = paired_ratios(cpu[a], cpu[b])
    return out


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "ray":
        _ray_driver(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    else:
        sys.exit("usage: paired.py ray NAME OUT ARGS_JSON (started by benchmarks/run.py)")
