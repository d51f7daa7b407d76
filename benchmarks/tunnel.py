"""The virtual tailnet's WireGuard tunnel against the bare veth it rides on.

``python -m benchmarks.tunnel [--reps 5] [--seconds 2]`` (root; from the repository root):
builds one 2-node ``NetnsCluster`` (``tunnel="wireguard"``, no Ray) and measures TCP
throughput node 0 -> node 1 with ray_mesh's own link probe (``ray_mesh.network.links``,
receiver-side count, bounded by seconds and bytes) over

* ``tunnel``: the ``tailscale0`` addresses (WireGuard in userspace, ``wireguard-go``,
  MTU 1280), and
* ``veth``: the ``lan0`` addresses of the same two nodes: the veth pair + bridge the
  tunnel's UDP travels on, with no tunnel,

alternating (veth, tunnel, veth, ...) so a change of machine load hits both alike.
Statistic: median of ``reps`` transfers each (min and max beside); the load average at
start and end is recorded, since encryption is CPU-bound on this 2-core machine. Also the
cluster's bring-up time for each mode (namespaces, devices, handshakes; one each).
Writes ``benchmarks/results_tunnel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results_tunnel.json"


def _bringup_s(tunnel: str) -> float:
    from harness.netns import NetnsCluster

    t0 = time.monotonic()
    with NetnsCluster([{}, {}], start_ray=False, tunnel=tunnel):
        return time.monotonic() - t0


def measure(reps: int = 5, seconds: float = 2.0) -> dict:
    from harness.netns import NetnsCluster, netns_unavailable_reason
    from ray_mesh.network.links import measure_links

    if reason := netns_unavailable_reason():
        return {"status": f"not run: {reason}"}
    load_start = os.getloadavg()
    out: dict = {"statistic": f"median of {reps} alternating transfers node 0 -> node 1, "
                              f"each at most {seconds:g} s or 4 GB, Mbit/s at the receiver",
                 "loadavg_start": load_start}
    rates: dict[str, list[float]] = {"veth": [], "tunnel": []}
    with NetnsCluster([{}, {}], start_ray=False) as cluster:
        agents = [cluster.agent(i) for i in range(2)]
        try:
            def run_on(i, fn, *args):
                return agents[i].call(fn, *args)

            addrs = {"veth": [n.lan_ip for n in cluster.nodes],
                     "tunnel": [n.ip for n in cluster.nodes]}
            for _ in range(reps):
                for kind in ("veth", "tunnel"):
                    m = measure_links(addrs[kind], run_on, max_s=seconds,
                                      max_bytes=4 * 2**30, within_node=False)
                    rates[kind].append(m.links[0].mbit_s)
        finally:
            for a in agents:
                a.close()
    for kind, xs in rates.items():
        out[kind] = {"median_mbit_s": statistics.median(xs), "min": min(xs), "max": max(xs),
                     "runs": xs}
    out["tunnel_over_veth"] = out["tunnel"]["median_mbit_s"] / out["veth"]["median_mbit_s"]
    out["bringup_s"] = {t: _bringup_s(t) for t in ("veth", "wireguard")}
    out["loadavg_end"] = os.getloadavg()
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    res = measure(args.reps, args.seconds)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0 if "status" not in res else 1


if __name__ == "__main__":
    raise SystemExit(main())
