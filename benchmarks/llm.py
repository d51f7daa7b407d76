"""The LM job (``examples/llm.py``): tokens/s under ray_mesh with Ray Data input against
torchrun with in-memory rows, same model, mesh, batches and steps, in one run.

Variants, run alternately (pair k = the k-th run of each; who goes first alternates):

* ``torchrun``: ``torchrun --nproc-per-node 4 examples/llm.py examples/llm.yaml``: every rank
  reads the training bytes once into a tensor of packed rows, and each step's batch is an
  in-memory gather of it (``global_rows``: a seeded permutation, then this dp rank's slice);
* ``ray_mesh``: the same job file through ``ray_mesh.cli.runner`` (what ``ray-mesh run``
  does): ``MeshConfig`` + ``TorchTrainer`` + the ``data:`` section as a Ray Data dataset
  (``read_binary_files`` -> ``map_batches`` packing), split by dp rank (``MeshDataConfig``),
  each step's batch from ``iter_torch_batches``.

Both read the same files in the same order (``data.shuffle_seed``), the same number of bytes,
and train the same model preset on dp_shard 2 x tp 2 with the same global batch and seq_len.
The figure is measured inside the train loop: rank 0's per-step seconds (the example's
``step_times``: from asking for the batch to the step's loss all-reduce, which waits for every
dp rank), the first ``warmup`` steps excluded; tokens/s = global tokens per step x steady
steps / their seconds. ``batch_wait_s`` is the part of a step spent waiting for its batch
(the Ray Data iterator, or the in-memory gather). Bring-up (launch -> the train loop's first
step: processes, mesh, model, optimizer) and the first batch's wait (Ray Data starting its
read, or reading the bytes into memory) are reported on their own. The machine's load average
is recorded before every run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, free_port, median, read_result, result_path  # noqa: E402

EXAMPLE = REPO / "examples" / "llm.py"
JOB = REPO / "examples" / "llm.yaml"
VARIANTS = ("torchrun", "ray_mesh")
STATISTIC = ("tokens_per_s: median over the runs of each run's steady-state tokens/s (rank 0's "
             "per-step seconds, the first `warmup` steps excluded); ray_mesh_vs_torchrun: "
             "median of the paired ratios ray_mesh[k] / torchrun[k] of tokens/s, q1 / q3 "
             "their quartiles, n pairs; bring_up_s (launch -> first step), first_batch_s: "
             "medians over the runs")


def config(args: dict) -> dict:
    """The job's config, shortened for timing: no report, eval or checkpoint mid-run."""
    return {"steps": args["steps"], "step_times": True, "report_every": 10**6,
            "eval_every": 10**6, "checkpoint_every": 0,
            **({"model": args["model"]} if args.get("model") else {})}


def steady(summary: dict, warmup: int, tokens_per_step: int) -> dict:
    """A run's figures from the example's summary (rank 0's per-step timings)."""
    steps, waits = summary["step_s"][warmup:], summary["batch_wait_s"][warmup:]
    if not steps:
        raise ValueError(f"llm: {len(summary['step_s'])} steps leave none after warmup "
                         f"{warmup}; raise steps or lower warmup.")
    return {"tokens_per_s": tokens_per_step * len(steps) / sum(steps),
            "step_s_median": statistics.median(steps),
            "batch_wait_s_median": statistics.median(waits),
            "batch_wait_fraction": sum(waits) / sum(steps),
            "first_step_s": summary["step_s"][0], "first_batch_s": summary["batch_wait_s"][0],
            "steady_steps": len(steps), "step_s": summary["step_s"],
            "batch_wait_s": summary["batch_wait_s"],
            "final_loss": list(summary["losses"].values())[-1]}


def run_torchrun(args: dict) -> dict:
    """One torchrun run of the example; its summary line is rank 0's JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("OMP_NUM_THREADS", None)  # torchrun sets 1 per rank, as Ray does per worker
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args['workers']}",
           "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           str(EXAMPLE), str(JOB), "--config", json.dumps(config(args))]
    launch = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO),
                          timeout=args["timeout_s"])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("llm: summary ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"llm torchrun failed (rc {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(lines[-1][len("llm: summary "):])
    summary["launch_unix"], summary["process_wall_s"] = launch, time.time() - launch
    return summary


def ray_train(config: dict) -> None:
    """The Ray variant's train function: the example's own ``train_loop``, whose summary
    rank 0 writes to ``summary_out`` (Ray Train 2.60 returns nothing from a worker)."""
    import torch.distributed as dist

    from benchmarks.common import write_result
    from ray_mesh.cli.job import load_function

    out = config.pop("summary_out")
    summary = load_function(f"{EXAMPLE}:train_loop")(config)
    if dist.get_rank() == 0:
        write_result(out, summary)


def run_ray(args: dict, storage: str) -> dict:
    """One run of the job file through the runner ``ray-mesh run`` uses, on this process's
    Ray (``benchmarks/run.py`` started it; its workers have this repository on PYTHONPATH)."""
    from ray_mesh.cli import runner
    from ray_mesh.cli.job import Job
    from ray_mesh.core.spec import load_yaml

    out = result_path("llm")
    doc = load_yaml(JOB)
    doc.update(name=f"llm_bench_{time.time_ns()}", train="benchmarks.llm:ray_train",
               config={**doc["config"], **config(args), "summary_out": out},
               run={**doc.get("run", {}), "storage_path": storage})
    job = Job.from_dict(doc, base_dir=JOB.parent)
    launch = time.time()
    runner.run_job_outcome(job)
    summary = read_result(out)
    summary["launch_unix"], summary["process_wall_s"] = launch, time.time() - launch
    return summary


def measure(args: dict, storage: str) -> dict:
    """``args["pairs"]`` pairs of runs, alternating; the figures and every run."""
    from benchmarks import paired
    from ray_mesh.core.spec import load_yaml
    from ray_mesh.data.spec import DataSpec

    data = DataSpec.from_dict(load_yaml(JOB)["data"])
    tokens_per_step = data.global_batch * data.seq_len
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for k in range(args["pairs"]):
        for variant in (VARIANTS if k % 2 == 0 else VARIANTS[::-1]):
            load = os.getloadavg()
            summary = (run_torchrun(args) if variant == "torchrun" else run_ray(args, storage))
            run = {**steady(summary, args["warmup"], tokens_per_step), "loadavg_before": load,
                   "bring_up_s": summary["loop_start_unix"] - summary["launch_unix"],
                   "process_wall_s": summary["process_wall_s"], "pair": k}
            runs[variant].append(run)
            print(f"[llm] pair {k} {variant}: {run['tokens_per_s']:.0f} tokens/s, batch wait "
                  f"{run['batch_wait_fraction']:.1%} of step time, first batch "
                  f"{run['first_batch_s']:.1f} s, bring-up {run['bring_up_s']:.1f} s, load "
                  f"{load[0]:.2f}", file=sys.stderr, flush=True)
    tps = {v: [r["tokens_per_s"] for r in runs[v]] for v in VARIANTS}
    out: dict = {"workload": "examples/llm.py + examples/llm.yaml",
                 "args": {**args, "tokens_per_step": tokens_per_step,
                          "mesh": "dp_shard 2 x tp 2", "job_config": config(args)},
                 "runs": runs, "statistic": STATISTIC}
    for v in VARIANTS:
        out[v] = {"tokens_per_s": median(tps[v]),
                  "bring_up_s": median([r["bring_up_s"] for r in runs[v]]),
                  "first_batch_s": median([r["first_batch_s"] for r in runs[v]]),
                  "batch_wait_fraction": median([r["batch_wait_fraction"] for r in runs[v]]),
                  "loadavg_before": [r["loadavg_before"][0] for r in runs[v]]}
    out["tokens_per_s"] = {v: out[v]["tokens_per_s"] for v in VARIANTS}
    r = paired.paired_ratios(tps["ray_mesh"], tps["torchrun"])
    out["ray_mesh_vs_torchrun"] = {"median": r["median_paired"], "q1": r["q1"], "q3": r["q3"],
                                   "n": r["rounds"], **r, "target": ">= 0.95",
                                   "statistic": "median of paired ratios of tokens/s"}
    return out

