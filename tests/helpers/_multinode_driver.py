"""Drivers that tests/test_multinode.py runs inside the head namespace of a NetnsCluster.

Each prints one line ``RESULT <json>`` that the test parses; everything else on stdout
(worker prints forwarded by Ray included) is kept for assertions on logs.

    python tests/helpers/_multinode_driver.py fits  STORAGE_DIR
    python tests/helpers/_multinode_driver.py cli   UNREACHABLE_ADDRESS
    python tests/helpers/_multinode_driver.py cli1  ARGV...   (one command; ``cli`` runs it)
    python tests/helpers/_multinode_driver.py linkcut GO_FILE [CUT_BOUND_S]
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import traceback


def _result(obj) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


# ----------------------------------------------------------------------------- fits
def train_fn(config: dict) -> None:
    import ray
    import ray.train
    import torch
    import torch.distributed as dist

    import ray_mesh

    mesh = ray_mesh.get_mesh()
    rank, world = dist.get_rank(), dist.get_world_size()
    # The rank print of the Ray-Train-over-Tailscale blog post.
    print(f"LOCAL_RANK={os.environ['LOCAL_RANK']} RANK={os.environ['RANK']} "
          f"WORLD_SIZE={os.environ['WORLD_SIZE']} NODE_RANK={os.environ['NODE_RANK']}",
          flush=True)
    ctx = ray.train.get_context()
    # Collectives across nodes: dp_replicate groups span the nodes.
    rep = torch.tensor([float(rank + 1)])
    dist.all_reduce(rep, group=mesh.get_group("dp_replicate"))
    world_sum = torch.tensor([float(rank + 1)])
    dist.all_reduce(world_sum)
    shard = torch.tensor([float(rank + 1)])
    dist.all_reduce(shard, group=mesh.get_group("dp_shard"))
    # Every named dim and flattened dim answers (size 1 ones too), with the right sums.
    groups, sums = {}, {}
    for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"):
        groups[d] = dist.get_process_group_ranks(mesh.get_group(d))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=mesh.get_group(d))
        sums[d] = t.item()
    state = ray_mesh.get_state()
    me = {
        "rank": rank,
        "world": world,
        "ip": ray.util.get_node_ip_address(),
        "ctx_local_rank": ctx.get_local_rank(),
        "ctx_node_rank": ctx.get_node_rank(),
        "env": {k: os.environ.get(k) for k in (
            "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
            "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_FAMILY",
            "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD")},
        "shard_group": dist.get_process_group_ranks(mesh.get_group("dp_shard")),
        "replicate_group": dist.get_process_group_ranks(mesh.get_group("dp_replicate")),
        "rep_sum": rep.item(),
        "shard_sum": shard.item(),
        "world_sum": world_sum.item(),
        "groups": groups, "sums": sums, "device": str(state.device),
        "coordinate": state.coordinate,
        "mesh_coordinate": dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True)),
        # MeshConfig sets every thread of the worker (gloo's, the training thread) to 0
        "niceness": sorted({os.getpriority(os.PRIO_PROCESS, int(t))
                            for t in os.listdir("/proc/self/task")}),
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    if rank == 0:  # Train V2 keeps metrics only with checkpoints: hand results over a file
        with open(config["out"], "w") as f:
            json.dump(everyone, f)
    ray.train.report({"done": 1})


def _fit(name: str, storage: str, mesh, interface: str = "auto",
         resources: dict | None = None, workers: int = 4) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mesh import MeshConfig

    start = time.monotonic()
    out_file = os.path.join(storage, f"{name}.json")
    os.makedirs(storage, exist_ok=True)
    try:
        TorchTrainer(
            train_fn,
            train_loop_config={"out": out_file},
            scaling_config=ScalingConfig(num_workers=workers, resources_per_worker=resources
                                         or {"CPU": 0.5, "slot": 1}),
            # verbose: every rank logs its environment line (the test reads all four).
            torch_config=MeshConfig(mesh=mesh, interface=interface, bringup_timeout_s=120,
                                    verbose=True),
            run_config=RunConfig(name=name, storage_path=storage),
        ).fit()
        with open(out_file) as f:
            out = {"ok": True, "everyone": json.load(f)}
    except Exception as exc:  # noqa: BLE001 - the error text is what the test checks
        out = {"ok": False, "error": "".join(traceback.format_exception(exc))}
    out["seconds"] = round(time.monotonic() - start, 1)
    return out


def fits(storage: str) -> None:
    import ray

    from ray_mesh import MeshSpec

    # A value the user sets (runtime_env) must win over ray_mesh's default, and be logged.
    ray.init(runtime_env={"env_vars": {"NCCL_SOCKET_NTHREADS": "2"}})
    out = {}
    # Bad runs first, then a good one from the same driver: a failed bring-up must not
    # wedge the next fit (DESIGN.md).
    # (An interface that does not exist is checked through `ray-mesh doctor` in `cli`, and
    # MeshConfig's driver-side path for it in the unit tests: each fit costs ~1 min here.)
    out["decoy_iface"] = _fit("decoy", storage, MeshSpec.hsdp(), interface="eth0",
                              resources={"CPU": 0.5, "slot": 2}, workers=2)
    out["unequal"] = _fit("unequal", storage, MeshSpec.hsdp(),
                          resources={"CPU": 0.25, "uneq": 1})
    out["good"] = _fit("good", storage, MeshSpec.hsdp())
    _result(out)


# ----------------------------------------------------------------------------- cli
def _cli(argv: list[str]) -> dict:
    from ray_mesh.cli.main import main

    buf_out, buf_err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
        except Exception:  # noqa: BLE001
            rc = "crash"
            buf_err.write(traceback.format_exc())
    return {"rc": rc, "out": buf_out.getvalue(), "err": buf_err.getvalue(),
            "seconds": round(time.monotonic() - start, 1)}


def _import_cli() -> None:
    import ray_mesh.cli.runner  # noqa: F401
    import ray_mesh.planning.cluster  # noqa: F401 - imports first: time only the commands
    import ray_mesh.raytrain.cluster  # noqa: F401


def cli1(*argv: str) -> None:
    """One command in a process of its own (see ``cli``)."""
    _import_cli()
    _result(_cli(list(argv)))


def _start_cli1(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "cli1", *argv],
                            stdout=subprocess.PIPE, text=True)


def _cli1_result(proc: subprocess.Popen) -> dict:
    text, _ = proc.communicate(timeout=120)
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"rc": f"no result (exit {proc.returncode})", "out": text[-3000:], "err": "",
                "seconds": None}
    return json.loads(lines[-1][len("RESULT "):])


def cli(unreachable: str) -> None:
    address = os.environ["RAY_ADDRESS"]
    # An address nobody answers on, before any ray.init in its process: asked from a process
    # of its own, which waits out the command's 5 s bound (no work) while this one runs the
    # others (one at a time: each redirects this process's stdout). Timed inside that
    # process, as here.
    bad_address = _start_cli1(["plan", "--address", unreachable])
    _import_cli()
    out = {}
    out["plan"] = _cli(["plan", "--address", address, "--resource", "slot"])
    out["plan_uneq"] = _cli(["plan", "--address", address, "--resource", "uneq"])
    out["plan_tp"] = _cli(["plan", "--address", address, "--resource", "slot",
                           "--layout", "tp_pp"])
    out["doctor"] = _cli(["doctor", "--address", address])
    out["doctor_decoy"] = _cli(["doctor", "--address", address, "--interface", "eth0"])
    out["doctor_missing"] = _cli(["doctor", "--address", address, "--interface", "wlan0"])
    out["bad_address"] = _cli1_result(bad_address)
    _result(out)


# ----------------------------------------------------------------------------- link cut
def linkcut(go_file: str, cut_bound_s: str = "20") -> None:
    """The pre-flight while every link is up (the default 20 s bound), then, after the test
    cut node 1's link, one bounded by ``cut_bound_s`` (the cut node never answers: the
    pre-flight returns when that bound fires)."""
    import ray

    from ray_mesh.raytrain.cluster import NodeAgents, live_nodes

    ray.init()
    nodes = [n for n in live_nodes() if n.alive]
    # One agent per node, started while every link is up (node 1 has joined) ...
    agents = NodeAgents(nodes, startup_timeout_s=120)
    report_before = agents.preflight(timeout_s=20)
    print("READY", flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    # ... then the test cuts node 1's link and the pre-flight must fail within its bound.
    start = time.monotonic()
    report = agents.preflight(timeout_s=float(cut_bound_s))
    elapsed = time.monotonic() - start
    _result({"before_ok": report_before.ok, "before": report_before.format(),
             "ok": report.ok, "elapsed": elapsed,
             "problems": report.problems, "text": report.format(),
             "message": report.error_message() if not report.ok else "",
             "nodes": [n.ip for n in nodes]})
    sys.stdout.flush()
    os._exit(0)  # ray.shutdown() could wait on the unreachable node


if __name__ == "__main__":
    {"fits": fits, "cli": cli, "cli1": cli1, "linkcut": linkcut}[sys.argv[1]](*sys.argv[2:])
