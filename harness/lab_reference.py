"""The lab job without any failure: its reference for the final held-out loss.

What it is: the job's own replica-group loop (``examples/llm.py``'s ``train_as_group``,
through :func:`harness.lab_train.run_logged`) as **one** group of one process, on a quorum
in the same process (:class:`harness.local_coordinator.LocalCoordinator`), no Ray, with
``segment_samples`` times the number of groups as its segment: every step takes
``groups x segment_samples`` samples, the whole step of the job when no group is missing.

Why it is a fair reference: the quorum hands samples out from the same books in the same
order (step ``s`` of an uninterrupted run uses indices ``[(s-1)B, sB)`` for ``B = groups x
segment_samples``, however the shares split them), the groups' average is weighted by
samples, i.e. the mean gradient over the step's tokens, and the model, initial weights,
optimizer, learning-rate schedule by step and held-out set are the job's own. What differs
from the job run on three groups: gradient clipping applies to each group's gradient before
the average there and to the whole step's here, and floating-point sums run in another
order; both move the loss far less than the 3% the lab test allows (and a failure-free run
on the cluster would differ from this one in the same ways). It costs one process's
compute of the job (24-27 s measured at a load of 7-25), against a second run of the job
on the cluster (~5 minutes at such a load).

Run it as ``python -m harness.lab_reference JOB_JSON GROUPS [OUT_DIR]`` (a process of its
own: it makes a torch.distributed world of one); :func:`reference` does that and returns
the loop's summary (``val_loss`` the held-out loss at the end).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def group_config(job: dict[str, Any]) -> dict[str, Any]:
    """The train function's config as ``ray-mesh run`` gives it to each group (the job's
    ``config:``, its checked ``data:`` and the manifest to read it by index)."""
    from ray_mesh.cli.job import Job
    from ray_mesh.data.indexed import INDEX_KEY, manifest

    checked = Job.from_dict(job, base_dir=REPO)
    return {**checked.config, "data": checked.data.to_dict(),
            INDEX_KEY: {"manifest": manifest(checked.data)}}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(job: dict[str, Any], groups: int, out_dir: str | None) -> dict[str, Any]:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    import ray_mesh
    from harness.lab_train import run_logged
    from harness.local_coordinator import LocalCoordinator
    from ray_mesh.replicas import ReplicaGroup
    from ray_mesh.replicas.link_store import serve_store
    from ray_mesh.replicas.quorum import Quorum

    section = job["replica_groups"]
    segment = int(section["segment_samples"]) * groups
    config = {**group_config(job), "step_log": out_dir}
    ray_mesh.init_mesh({"dp_shard": 1})
    store, address = serve_store("127.0.0.1")
    quorum = Quorum(segment_samples=segment, total_steps=int(section["steps"]),
                    expected_groups=1)
    client = LocalCoordinator(quorum, address)

    def make_group(model: Any, optim: Any, **kw: Any) -> Any:
        return ReplicaGroup(model, optim, client=client, group_id=0,
                            total_steps=int(section["steps"]), segment_samples=segment,
                            layout="dp_shard=1", **kw)

    t0 = time.monotonic()
    summary = run_logged(config, make_group)
    summary["wall_s"] = time.monotonic() - t0
    ray_mesh.shutdown_mesh()
    del store
    return summary


def reference(job: dict[str, Any], groups: int, out_dir: Path | None = None,
              timeout_s: float = 300.0, nice: int = 0, cgroup: Path | None = None
              ) -> dict[str, Any]:
    """Run the reference (see the module docstring) in a process of its own; its summary.
    ``cgroup``: run it there (e.g. one of ``IDLE_SHARES``, beside a lab it must not slow)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), "OMP_NUM_THREADS": "1"}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "harness.lab_reference", json.dumps(job), str(groups),
           str(out_dir or "")]
    if nice:
        cmd = ["nice", "-n", str(nice), *cmd]
    if cgroup is not None:
        from harness.netns.cpu import in_cgroup

        cmd = in_cgroup(cgroup, cmd)
    proc = subprocess.run(cmd, cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the reference run failed (rc {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


if __name__ == "__main__":
    result = _main(json.loads(sys.argv[1]), int(sys.argv[2]),
                   sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None)
    print("RESULT " + json.dumps(result, default=str), flush=True)
