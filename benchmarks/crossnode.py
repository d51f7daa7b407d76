"""Cross-node bytes per step on the virtual Tailscale cluster (2 nodes x 2 workers).

The host side starts ``harness.netns.NetnsCluster`` and runs this module as a driver
inside the head namespace (``python -m benchmarks.crossnode DRIVER_ARGS``), which runs two
fits of the same MLP: HSDP on ``mesh["dp_replicate", "dp_shard"]`` (2 x 2) and flat FSDP on
``mesh["dp_shard"]`` (4). Every worker on local rank 0 reads its own namespace's
``tailscale0`` counters (``workloads.crossnode_bytes``).

Theoretical minimum for HSDP: only the gradient all-reduce over ``dp_replicate`` crosses
nodes. An all-reduce of G bytes among R nodes must move at least 2(R-1)/R * G bytes out of
each node (reduce-scatter + all-gather lower bound; a ring reaches it), so the links carry
at least 2(R-1) * G bytes in all. Each node's shard groups together hold the whole
gradient, G = params * 4 bytes (fp32 gradients, FSDP2's default reduce dtype), hence
minimum = 2 (R-1) * params * 4 bytes per step; 8 * params for R = 2. Wire counters also
carry Ethernet/IP/TCP headers (66 B per packet with TCP timestamps) and ACKs; the report
gives both the raw wire bytes and the bytes with 66 B per packet taken off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.common import REPO, read_result, write_result

HEADER_BYTES = 66  # Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12


def minimum_bytes(params: int, nodes: int, dtype_bytes: int = 4) -> int:
    return 2 * (nodes - 1) * params * dtype_bytes


def _train(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    import ray_mesh
    from benchmarks import workloads

    state = ray_mesh.get_state()
    local_rank = ray.train.get_context().get_local_rank()
    out = workloads.crossnode_bytes(state.mesh, tuple(config["dims"]), config, local_rank)
    if dist.get_rank() == 0:
        write_result(config["out"], out)
    ray.train.report({"done": 1})


def _driver(args: dict) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mesh import MeshConfig, MeshSpec

    ray.init(runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    meshes = {
        "hsdp": (MeshSpec(dp_replicate=2, dp_shard=2), ("dp_replicate", "dp_shard")),
        "fsdp": (MeshSpec(dp_shard=4), ("dp_shard",)),
    }
    out = {}
    for name, (spec, dims) in meshes.items():
        path = os.path.join(args["storage"], f"{name}.json")
        os.makedirs(args["storage"], exist_ok=True)
        TorchTrainer(
            _train,
            train_loop_config={**args["model"], "dims": list(dims), "out": path},
            scaling_config=ScalingConfig(num_workers=4,
                                         resources_per_worker={"CPU": 0.5, "slot": 1}),
            torch_config=MeshConfig(mesh=spec, bringup_timeout_s=180),
            run_config=RunConfig(name=f"crossnode_{name}_{time.time_ns()}",
                                 storage_path=args["storage"]),
        ).fit()
        out[name] = read_result(path)
    print("RESULT " + json.dumps(out), flush=True)


def per_step(raw: dict) -> dict:
    """Bytes per step crossing nodes: wire, background-corrected, and without headers."""
    steps = raw["steps"]
    train, idle = raw["train"], raw["idle"]
    wire = train["tx_bytes"] - idle["tx_bytes"]
    packets = train["tx_packets"] - idle["tx_packets"]
    return {"wire_bytes_per_step": wire / steps,
            "payload_bytes_per_step": (wire - HEADER_BYTES * packets) / steps,
            "packets_per_step": packets / steps,
            "background_bytes_per_step": idle["tx_bytes"] / steps,
            "rx_tx_agree": abs(train["rx_bytes"] - train["tx_bytes"])
            <= 0.01 * max(train["tx_bytes"], 1)}


def measure(model: dict, timeout_s: float = 600.0) -> dict:
    """Start the namespace cluster, run both fits, return figures (or why not run)."""
    try:
        from harness.netns import NetnsCluster, netns_unavailable_reason
    except ImportError as exc:
        return {"status": f"not run: harness/netns/ is not importable ({exc})"}
    reason = netns_unavailable_reason(tunnel="veth")
    if reason:
        return {"status": f"not run: {reason}"}
    with NetnsCluster([{"slot": 2}, {"slot": 2}],
                      tunnel="veth") as cluster:  # bare veth, as the recorded figures
        env = cluster.node_env(cluster.head)
        env.update(RAY_ADDRESS=cluster.address, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        storage = str(cluster.root / "results")
        args = {"model": model, "storage": storage}
        cmd = [*cluster.head.exec_prefix(), sys.executable, "-m", "benchmarks.crossnode",
               json.dumps(args)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=env, cwd=str(REPO))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cross-node driver failed (rc {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    raw = json.loads(lines[-1][len("RESULT "):])
    params = raw["hsdp"]["params"]
    minimum = minimum_bytes(params, nodes=2)
    out = {"status": "ok", "params": params, "dtype_bytes": 4,
           "minimum_bytes_per_step": minimum,
           "minimum_formula": "2 * (nodes - 1) * params * 4 B (all-reduce lower bound, R=2)",
           "statistic": "one run: the nodes' tailscale0 tx bytes over the timed steps, minus "
                        "an idle window of the same length, divided by the steps"}
    for name in ("hsdp", "fsdp"):
        out[name] = {**per_step(raw[name]), "raw": raw[name]}
    out["hsdp_vs_min_wire"] = out["hsdp"]["wire_bytes_per_step"] / minimum
    out["hsdp_vs_min_payload"] = out["hsdp"]["payload_bytes_per_step"] / minimum
    out["fsdp_vs_hsdp_wire"] = (out["fsdp"]["wire_bytes_per_step"]
                                / out["hsdp"]["wire_bytes_per_step"])
    return out


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    _driver(json.loads(sys.argv[1]))
