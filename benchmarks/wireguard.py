"""What the virtual tailnet's WireGuard tunnel costs a training run, against bare veth.

``python benchmarks/run.py --only wireguard`` (root). Two parts, each side by side in one run:

* **steps and bytes** (``benchmarks/slowlinks.py``, 2 namespace nodes x 2 workers): for each
  link rate (unshaped, 100 and 20 Mbit/s, a ``tbf`` on the link under the tunnel), a
  cluster on bare veth and one on WireGuard (``wireguard-go``, MTU 1280) take turns, rate by
  rate, each running every candidate layout of the planner with its prediction beside it.
  ``step_vs_veth``: the HSDP layout's median step on WireGuard over the same on veth;
  ``bytes_vs_veth``: its cross-node bytes per step, counted on the link under the tunnel
  (what the wire carries: WireGuard's UDP, its 32-byte header and the smaller packets of
  MTU 1280) and on ``tailscale0`` (what the job sends); ``predicted_vs_measured``: the
  planner's calibrated prediction over the measured median step, every layout and rate, on
  WireGuard (veth beside it).
* **checkpoints** (``checkpoint_bucket_vs_local``): local Ray, 4 CPU workers, HSDP 2 x 2, a
  ray_mesh ``Checkpointer`` saving a model of ``params`` parameters (with AdamW's two
  moments) through Ray Train, to a local directory and to an S3 bucket on a moto server
  (``ray-mesh storage serve``, as the docs start it), taking turns; then a fresh fit
  restores each. Statistic: the median over ``reps`` runs of the slowest rank's seconds in
  ``Checkpointer.report`` at a save step (DCP write + Ray Train's upload) and in
  ``Checkpointer.restore`` (download + DCP read + integrity check).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, free_port, median, ratio
from benchmarks.report import HSDP_2X2 as HSDP

RATES = (None, 100, 20)


def _steps_and_bytes(rates, steps: int, timeout_s: float) -> dict:
    from benchmarks import slowlinks

    sides: dict[str, dict] = {"veth": {}, "wireguard": {}}
    for k, mbit in enumerate(rates):
        order = ["veth", "wireguard"] if k % 2 == 0 else ["wireguard", "veth"]
        for tunnel in order:
            print(f"[wireguard] {tunnel} at {mbit or 'unshaped'} Mbit/s", file=sys.stderr,
                  flush=True)
            got = slowlinks.measure(rates=(mbit,), steps=steps, timeout_s=timeout_s,
                                    tunnel=tunnel)
            if "status" in got:
                return {"status": f"{tunnel}: {got['status']}"}
            sides[tunnel].update({key: sec for key, sec in got.items()
                                  if isinstance(sec, dict) and "set_mbit" in sec})
            sides[tunnel].setdefault("model", got["model"])
    out: dict = {"step_vs_veth": {}, "bytes_vs_veth": {}, "payload_bytes_vs_veth": {},
                 "predicted_vs_measured": {}, "predicted_vs_measured_veth": {},
                 "hsdp": {}, "runs": sides}
    for key, wg in sides["wireguard"].items():
        veth = sides["veth"].get(key)
        if key == "model" or not veth or HSDP not in wg or HSDP not in veth:
            continue
        a, b = wg[HSDP], veth[HSDP]
        out["step_vs_veth"][key] = ratio(a["measured_step_s"], b["measured_step_s"])
        out["bytes_vs_veth"][key] = ratio(a["wire_bytes_per_step"], b["wire_bytes_per_step"])
        out["payload_bytes_vs_veth"][key] = ratio(a["cross_node_bytes_per_step"],
                                                  b["cross_node_bytes_per_step"])
        out["hsdp"][key] = {side: {f: sec[HSDP][f] for f in (
            "measured_step_s", "predicted_step_s", "wire_bytes_per_step",
            "cross_node_bytes_per_step")} | {"cross_mbit": sec["measured_links"]["cross_mbit"],
                                             "loadavg_1m_before_after":
                                                 sec["loadavg_1m_before_after"]}
            for side, sec in (("wireguard", wg), ("veth", veth))}
        for sec, dest in ((wg, "predicted_vs_measured"), (veth, "predicted_vs_measured_veth")):
            out[dest][key] = {lay: row["predicted_step_s"] / row["measured_step_s"]
                              for lay, row in sec.items()
                              if isinstance(row, dict) and "measured_step_s" in row}
    worst = [abs(v - 1) for rows in out["predicted_vs_measured"].values() for v in rows.values()]
    out["predicted_vs_measured_worst_error"] = max(worst) if worst else None
    return out


# ----------------------------------------------------------------------------- checkpoints
def _ckpt_train(config: dict) -> None:
    """A save run (``config["saves"]`` checkpoints) or a restore run; rank 0 writes the
    slowest rank's seconds of each."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import ray_mesh
    from ray_mesh.checkpointing import Checkpointer

    mesh = ray_mesh.get_mesh()
    torch.manual_seed(0)
    width = config["width"]
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(config["layers"])])
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(model, optim, every=1)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    t0 = time.perf_counter()
    start = ckpt.restore()
    out = {"restore_s": slowest(time.perf_counter() - t0), "restored_step": start.step,
           "save_s": []}
    for step in range(start.step, start.step + config["saves"]):
        model(torch.randn(4, width)).square().mean().backward()
        optim.step()
        optim.zero_grad()
        t0 = time.perf_counter()
        ckpt.report(step + 1, {"step": step + 1})
        out["save_s"].append(slowest(time.perf_counter() - t0))
    ckpt.close()
    if dist.get_rank() == 0:
        Path(config["out"]).write_text(json.dumps(out))


def _fit(storage: str, name: str, config: dict, endpoint: str | None) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import ray_mesh
    from ray_mesh.core.object_store import run_storage

    TorchTrainer(_ckpt_train, train_loop_config=config,
                 scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
                 torch_config=ray_mesh.MeshConfig(mesh=ray_mesh.MeshSpec(dp_replicate=2,
                                                                         dp_shard=2)),
                 run_config=RunConfig(name=name, **run_storage(storage, endpoint))).fit()
    return json.loads(Path(config["out"]).read_text())


def _serve_bucket(work: Path) -> tuple[subprocess.Popen, str, str]:
    """``ray-mesh storage serve`` (a moto server) on a free port; its endpoint and a bucket."""
    from ray_mesh.cli.storage import READY

    port = free_port()
    with open(work / "serve.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "ray_mesh.cli.main", "storage",
                                 "serve", "--port", str(port), "--bucket", "bench",
                                 "--key-file", str(work / "storage.env")],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=str(REPO))
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while READY not in (work / "serve.log").read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("ray-mesh storage serve did not start:\n"
                               + (work / "serve.log").read_text()[-2000:])
        time.sleep(0.5)
    return proc, endpoint, "s3://bench/runs"


def _checkpoints(reps: int, width: int, layers: int) -> dict:
    import ray

    work = Path(tempfile.mkdtemp(prefix="rmbench_ckpt_"))
    from ray_mesh.cli.storage_guard import make_key, write_key_file

    key = make_key()  # the server's key (it answers signed requests only), made here first:
    write_key_file(work / "storage.env", key)  # the local Ray's workers inherit it
    os.environ.update(AWS_ACCESS_KEY_ID=key[0], AWS_SECRET_ACCESS_KEY=key[1],
                      AWS_EC2_METADATA_DISABLED="true")
    server, endpoint, bucket = _serve_bucket(work)
    runs: dict[str, list[dict]] = {"local": [], "bucket": []}
    try:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
                 _temp_dir=str(work / "ray"))
        for rep in range(reps):
            for where in (("local", "bucket") if rep % 2 == 0 else ("bucket", "local")):
                storage = str(work / "local") if where == "local" else bucket
                ep = endpoint if where == "bucket" else None
                name = f"ckpt_{where}_{rep}"
                cfg = {"width": width, "layers": layers, "saves": 2,
                       "out": str(work / f"{name}_save.json")}
                saved = _fit(storage, name, cfg, ep)
                restored = _fit(storage, name, {**cfg, "saves": 0,
                                                "out": str(work / f"{name}_restore.json")}, ep)
                assert restored["restored_step"] == 2, restored
                runs[where].append({"save_s": saved["save_s"],
                                    "restore_s": restored["restore_s"]})
                print(f"[wireguard] checkpoint {where} rep {rep}: save {saved['save_s']}, "
                      f"restore {restored['restore_s']:.2f} s", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)
    params = layers * (width * width + width)
    med = {w: {"save_s": median([max(r["save_s"]) for r in rs]),
               "restore_s": median([r["restore_s"] for r in rs])} for w, rs in runs.items()}
    return {"save": ratio(med["bucket"]["save_s"], med["local"]["save_s"]),
            "restore": ratio(med["bucket"]["restore_s"], med["local"]["restore_s"]),
            "seconds": med, "runs": runs, "params": params,
            "state_bytes": params * 4 * 3,  # fp32 weights + AdamW's two moments
            "statistic": f"median over {reps} runs of the slowest rank's seconds (save: the "
                         "slower of each run's two saves); ratios: bucket over local"}


def measure(rates=RATES, steps: int = 6, timeout_s: float = 1500.0, reps: int = 3,
            width: int = 1024, layers: int = 8) -> dict:
    """Both parts; the figures for ``results.json['wireguard']``."""
    load = os.getloadavg()
    out = _steps_and_bytes(list(rates), steps, timeout_s)
    out["checkpoint_bucket_vs_local"] = _checkpoints(reps, width, layers)
    out["loadavg_start_end"] = [load, os.getloadavg()]
    out["statistic"] = ("step_vs_veth, bytes_vs_veth: ratios of the HSDP layout's median "
                        f"step over {steps} timed steps (bytes: mean per step), WireGuard over "
                        "veth, one fit each, taking turns rate by rate; "
                        "predicted_vs_measured: predicted over measured median step")
    return out
