"""Ray on the namespace nodes: ``ray start`` through the project's deploy scripts, the
bounded wait for the nodes to join, and the reachability wait used after a link cut."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path
from typing import Protocol

from harness.netns.cpu import in_cgroup, make_cgroup
from harness.netns.namespaces import Node


class NetnsCluster(Protocol):
    """What starting Ray on a node and waiting for the nodes need of a virtual cluster
    (``harness.netns.cluster.NetnsCluster``, which builds on this module)."""

    address: str
    dashboard: bool
    node_cpus: dict[int, float]
    nodes: list[Node]
    num_cpus: int
    ray_start_timeout_s: float
    start_attempts: int

    def node_env(self, node: Node) -> dict[str, str]: ...

    def run_python(self, code: str, *, node: int = 0, timeout: float = 300,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess: ...

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "tailscale"

# Inside a namespace: wait until every address answers TCP (a refusal is an answer).
REACH_SCRIPT = """
import errno, socket, sys, time
deadline = time.monotonic() + float(sys.argv[1])
pending = set(sys.argv[2:])
last = {}
while pending and time.monotonic() < deadline:
    for addr in sorted(pending):
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        with socket.socket(fam) as s:
            s.settimeout(1.0)
            code = s.connect_ex((addr, 9))
        if code in (0, errno.ECONNREFUSED):
            pending.discard(addr)
        else:
            last[addr] = errno.errorcode.get(code, code)
    if pending:
        time.sleep(0.2)
if pending:
    left = sorted((a, last.get(a)) for a in pending)
    sys.exit(f"still unreachable after {sys.argv[1]} s: {left}")
"""


def start_ray_node(cluster: NetnsCluster, index: int) -> subprocess.CompletedProcess:
    """``ray start`` in node ``index`` through the deploy scripts (head for index 0)."""
    node = cluster.nodes[index]
    extra = [
        f"--temp-dir={node.temp_dir}",  # the node's private disk (namespaces.NODE_LOCAL)
        f"--num-cpus={cluster.num_cpus}",
        "--num-gpus=0",
        f"--resources={json.dumps(node.resources)}",
        "--object-store-memory=100000000",
    ]
    if index == 0:
        cmd = [str(DEPLOY / "ray-head.sh"), *extra,
               f"--include-dashboard={str(cluster.dashboard).lower()}"]
    else:
        cmd = [str(DEPLOY / "ray-worker.sh"), cluster.address, *extra]
    cmd = [*node.exec_prefix(), *cmd]
    if index in cluster.node_cpus:  # a slower box: the node and all it starts, under a quota
        # (joined before entering the node: its private mounts hide the host's cgroup tree)
        cmd = in_cgroup(make_cgroup(node.ns, cluster.node_cpus[index]), cmd)
    # `ray start` gives a raylet a fixed 30 s to register; on a machine shared with
    # other test runs that can pass, so a failed start is cleaned up and tried again.
    for attempt in range(cluster.start_attempts):
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=cluster.ray_start_timeout_s, env=cluster.node_env(node))
        if proc.returncode == 0:
            return proc
        node.kill_work()
        if attempt + 1 < cluster.start_attempts:  # a clean temp dir, inside the node
            subprocess.run([*node.exec_prefix(), "sh", "-c",
                            f'rm -rf "{node.temp_dir}" && mkdir -p "{node.temp_dir}"'],
                           capture_output=True, timeout=60)
    raise RuntimeError(f"ray start on node {index} ({node.ns}) failed "
                       f"{cluster.start_attempts} times; last (rc {proc.returncode}):\n"
                       f"{proc.stdout}\n{proc.stderr}")


def wait_for_nodes(cluster: NetnsCluster, count: int, timeout_s: float = 90.0) -> None:
    """Block until ``count`` nodes are alive in the cluster (bounded)."""
    code = textwrap.dedent(f"""\
        import time, ray
        ray.init(address={cluster.address!r}, log_to_driver=False)
        deadline = time.monotonic() + {timeout_s}
        while time.monotonic() < deadline:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= {count}:
                print("ALIVE", len(alive)); break
            time.sleep(0.5)
        else:
            raise SystemExit(f"only {{len(alive)}} of {count} nodes alive")
    """)
    cluster.run_python(code, timeout=timeout_s + 30)


__all__ = ["DEPLOY", "REACH_SCRIPT", "start_ray_node", "wait_for_nodes"]
