"""Driver run inside the head namespace of a NetnsCluster: train, and ask ``ray-mesh status``
until its verdict names the expected culprit (tests/netns/test_slow_netns.py,
benchmarks/slow.py).

    python harness/slow_driver.py CONFIG_JSON

Config: name, storage, dashboard (http://ip:8265), deadline_s (after training starts),
expect ("link" or "rank"), slow_rank / busy_s / width (for the train loop). Prints one line
``RESULT <json>``: the verdict, the seconds from training start to a status that names the
culprit, the last status run (ranks, per dim slowest rank, links).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path


def train_fn(config: dict) -> None:
    import ray.train

    from harness.slow_train import slow_loop

    if ray.train.get_context().get_world_rank() == 0:
        with open(config["started_file"], "w") as f:
            json.dump({"t": time.time()}, f)
    slow_loop(config)


def _names_culprit(run: dict, config: dict) -> bool:
    slow = run.get("slow") or {}
    if config["expect"] == "rank":
        return slow.get("straggler") == config["slow_rank"]
    return bool(slow.get("slow_link")) and slow.get("straggler") is None


def main() -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mesh import MeshConfig, MeshSpec
    from ray_mesh.status.cluster import collect

    config = json.loads(sys.argv[1])
    os.makedirs(config["storage"], exist_ok=True)
    config["started_file"] = os.path.join(config["storage"], f"{config['name']}.started")
    config["stop_file"] = os.path.join(config["storage"], f"{config['name']}.stop")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # `harness` importable
    ray.init(runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
        [os.environ.get("PYTHONPATH", ""), repo])}})
    fit: dict = {}

    def run_fit() -> None:
        try:
            TorchTrainer(
                train_fn, train_loop_config=config,
                scaling_config=ScalingConfig(num_workers=4,
                                             resources_per_worker={"CPU": 0.5, "slot": 1}),
                torch_config=MeshConfig(mesh=MeshSpec.hsdp(), bringup_timeout_s=180,
                                        measure_links=True, link_probe_s=2.0),
                run_config=RunConfig(name=config["name"], storage_path=config["storage"]),
            ).fit()
            fit["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported to the test
            fit["error"] = "".join(traceback.format_exception(exc))[-4000:]

    thread = threading.Thread(target=run_fit, daemon=True)
    thread.start()
    out: dict = {"found": False}
    give_up = time.monotonic() + 400  # bring-up on a loaded host, then deadline_s
    started = None
    last_error = None
    while time.monotonic() < give_up and thread.is_alive():
        time.sleep(2.0)
        if started is None and os.path.exists(config["started_file"]):
            with open(config["started_file"]) as f:
                started = json.load(f)["t"]
            give_up = time.monotonic() + config["deadline_s"]
        if started is None:
            continue
        try:
            status = collect(config["dashboard"], timeout_s=10.0)
        except Exception as exc:  # noqa: BLE001 - keep asking until the deadline
            last_error = f"{type(exc).__name__}: {exc}"
            continue
        run = next((r for r in status.runs if r["name"] == config["name"]), None)
        if run is None:
            continue
        out.update(run=run, notes=status.notes, verdict=(run.get("slow") or {}).get("verdict"))
        if _names_culprit(run, config):
            out.update(found=True, detect_s=round(time.time() - started, 1))
            break
    out["last_error"] = last_error
    out["started"] = started is not None
    with open(config["stop_file"], "w") as f:
        f.write("stop")
    thread.join(120)
    out["fit"] = fit
    print("RESULT " + json.dumps(out, default=str), flush=True)


# ----------------------------------------------------------------------------- host side
def run_in_cluster(cluster, config: dict, deadline_s: float, timeout: float = 700) -> dict:
    """Run this driver in ``cluster``'s head namespace (a NetnsCluster started with
    ``dashboard=True``); its RESULT."""
    node = cluster.head
    here = Path(__file__).resolve().parent
    env = cluster.node_env(node)
    env.update(RAY_ADDRESS=cluster.address, PYTHONUNBUFFERED="1",
               RAY_TRAIN_ENABLE_STATE_TRACKING="1",
               # Ray Train's controller looks at the workers every 2 s by default: the fit's
               # start and its end (after the stop file) would wait for it.
               RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.2",
               PYTHONPATH=str(here.parent))  # the repository: `harness` importable
    config = {"dashboard": f"http://{node.ip}:8265", "deadline_s": deadline_s, "width": 256,
              **config}
    proc = subprocess.run([*node.exec_prefix(), sys.executable, str(Path(__file__).resolve()),
                           json.dumps(config)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"driver gave no result (rc {proc.returncode}):\n"
                           f"{proc.stdout[-5000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("RESULT "):])


if __name__ == "__main__":
    main()
