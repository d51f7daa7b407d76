"""Recovery time (section f): a worker's SIGKILL to the first training step after the resume.

One ``TorchTrainer`` run of the checkpoint tests' train function (``harness/
ckpt_train.py``: HSDP 2x2 toy model, FSDP2, a ``Checkpointer`` every 2 steps, 4 workers,
``MeshConfig``), ``FailureConfig(max_failures=1)``. On the first attempt rank 1 writes a
marker file and SIGKILLs itself right after step ``kill_at``; Ray Train notices, restarts
the worker group, ``MeshConfig`` brings the mesh up again and the train function restores
the last checkpoint. Rank 0 logs every step with the wall clock (``time.time()``, one
clock for every process of the machine, namespaces included). Figures of that one run:

* ``recovery_s``: the marker's mtime (the kill) to the first step completed after resume;
* ``kill_to_restart_s``: the kill to the restored train function's start (failure
  detection + new worker group + mesh + checkpoint restore);
* ``fit_to_first_step_s``: ``fit()`` called to the first step of the first attempt.

Where: ``local`` on the benchmark's local Ray; ``netns`` on the virtual Tailscale cluster
(``harness/netns/``: 2 namespace nodes x 2 workers over ``tailscale0``),
which also gives ``cluster_up_s``: namespaces, links and ``ray start`` on every node until
the cluster answers. Ray Train's defaults are kept (health check every 2 s:
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``), as a user gets them.

``python benchmarks/recovery.py drive WORKDIR [RESOURCE]`` is the driver the netns part runs
inside the head namespace; it prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO  # noqa: E402

TRAIN = str(REPO / "harness" / "ckpt_train.py") + ":train_loop"
KILL_AT, STEPS, EVERY = 5, 8, 2
STATISTIC = ("one run per place: seconds from the SIGKILL of worker rank 1 to the first "
             "training step completed after the resume (recovery_s)")


def _figures(work: Path, t_fit: float) -> dict:
    """The run's figures from rank 0's log and the kill marker (see the module doc)."""
    from harness.ckpt_train import attempts, steps

    def at(line: str) -> float:
        return float(line.rsplit("@", 1)[1])

    runs = attempts(work / "run.log")
    if len(runs) != 2:
        raise RuntimeError(f"expected 2 attempts (killed, resumed), got {len(runs)}: {runs}")
    first, second = runs
    kill_t = (work / "killed").stat().st_mtime
    first_steps = [x for x in first if x.startswith("step")]
    resumed = [x for x in second if x.startswith("step")]
    if steps(resumed)[-1] != STEPS or not first_steps:
        raise RuntimeError(f"the resumed run did not finish: {runs}")
    return {"recovery_s": at(resumed[0]) - kill_t,
            "kill_to_restart_s": at(second[0]) - kill_t,
            "fit_to_first_step_s": at(first_steps[0]) - t_fit,
            "killed_after_step": KILL_AT, "resumed_from_step": int(second[0].split()[1]),
            "first_step_after_resume": steps(resumed)[0], "steps": STEPS,
            "checkpoint_every": EVERY, "workers": 4,
            "health_check_interval_s": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S",
                                                      "Ray's default (2)")}


def drive(work: Path, storage: str, resource: str | None = None) -> dict:
    """Fit once with the kill; needs a connected Ray (``ray.init`` done)."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh
    from ray_mesh.cli.job import load_function

    work.mkdir(parents=True, exist_ok=True)
    per_worker = {"CPU": 0.5, resource: 1} if resource else {"CPU": 1}
    trainer = TorchTrainer(
        load_function(TRAIN),
        train_loop_config={"steps": STEPS, "every": EVERY, "kill_at": KILL_AT,
                           "kill_marker": str(work / "killed"), "log": str(work / "run.log"),
                           "final": str(work / "final.pt"), "upload": False},
        scaling_config=ScalingConfig(num_workers=4, resources_per_worker=per_worker),
        torch_config=ray_mesh.MeshConfig(mesh={"dp_replicate": 2, "dp_shard": 2}),
        run_config=RunConfig(name=f"recovery_{time.time_ns()}", storage_path=storage,
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    t_fit = time.time()
    result = trainer.fit()
    if result.error is not None:
        raise RuntimeError(f"recovery run failed: {result.error}")
    return _figures(work, t_fit)


def measure_local(work: Path, storage: str) -> dict:
    """On the Ray instance this process is connected to."""
    return {"status": "ok", **drive(work, storage)}


def measure_netns(timeout_s: float = 900.0) -> dict:
    """Bring the virtual cluster up (timed), then the same run from its head namespace."""
    from harness.netns import NetnsCluster, netns_unavailable_reason

    reason = netns_unavailable_reason(tunnel="veth")
    if reason:
        return {"status": f"not run: {reason}"}
    t0 = time.monotonic()
    with NetnsCluster([{"slot": 2}, {"slot": 2}],
                      tunnel="veth") as cluster:  # bare veth, as the recorded figures
        cluster_up_s = time.monotonic() - t0
        env = cluster.node_env(cluster.head)
        env.update(RAY_ADDRESS=cluster.address, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        work = cluster.root / "recovery"
        cmd = [*cluster.head.exec_prefix(), sys.executable, str(Path(__file__).resolve()),
               "drive", str(work), "slot"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=env, cwd=str(REPO))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"recovery driver failed (rc {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return {"status": "ok", "cluster_up_s": cluster_up_s, "nodes": 2,
            **json.loads(lines[-1][len("RESULT "):])}


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "drive":
        import ray

        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
        ray.init(address="auto", log_to_driver=False)
        work_dir = Path(sys.argv[2])
        res = drive(work_dir, str(work_dir / "results"), *sys.argv[3:])
        print("RESULT " + json.dumps(res), flush=True)
        sys.stdout.flush()
        os._exit(0)  # ray.shutdown() can wait on a dead worker's node
    else:
        sys.exit("usage: recovery.py drive WORKDIR [RESOURCE] (started by benchmarks/run.py)")
