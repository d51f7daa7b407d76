"""Does a pipeline's send across a slow link overlap the receiver's compute? (gloo, netns)

The planner's GPipe model (``benchmarks.planning_lab.gpipe``) lets a link carry microbatch ``m``
only once the receiving stage has posted its recv, which torch's ``ScheduleGPipe`` does
right before computing ``m``. This measures that on the virtual cluster, without a model:
2 nodes x 2 ranks, every link shaped; rank j of node 0 sends 4 microbatches (``mb_kib``
each) to rank j of node 1 the way the schedule does (``isend`` all, wait at the end); the
receivers "compute" ``c`` seconds (a sleep, so no CPU is taken from the network path)
after each microbatch and post the next recv either

* ``late``: just before it is needed (ScheduleGPipe's order), or
* ``early``: all four recvs at once before the first compute (what overlap would need), or
* ``late_tp``: late, the two receivers of a node held in lockstep the way TP ranks are (a
  one-element all-reduce between them after each compute, as TP's per-layer collectives).

Beside each measurement: ``serial_ms`` = 4 x (send + c) (link and compute take turns) and
``overlapped_ms`` = 4 x send + c where the link is the slower, send + 4 x c where the
compute is (the two in parallel), ``side_by_side_ms`` the planner's model for receivers
that are independent pipelines (each alone on the link at twice the shared rate while the
other computes, together no faster than the link), ``send`` being the measured
per-microbatch time at c = 0.
Statistic: median of ``reps`` repeats (each the slowest rank's time, after one warm-up).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import REPO

WORKER = r'''
import json, sys, time, datetime, torch, torch.distributed as dist
args = json.loads(sys.argv[1])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
peer = (rank + 2) % 4
n = args["microbatches"]
bufs = [torch.zeros(args["mb_kib"] * 256) for _ in range(n)]
node_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
one = torch.zeros(1)
out = {}
for order in ("late", "early", "late_tp"):
    for c in args["compute_s"]:
        times = []
        for rep in range(args["reps"] + 1):
            dist.barrier()
            t = time.perf_counter()
            if rank < 2:
                for w in [dist.isend(b, peer) for b in bufs]:
                    w.wait()
            elif order in ("late", "late_tp"):
                for b in bufs:
                    dist.irecv(b, peer).wait()
                    time.sleep(c)
                    if order == "late_tp":
                        dist.all_reduce(one, group=node_groups[1])
            else:
                works = [dist.irecv(b, peer) for b in bufs]
                for w in works:
                    w.wait()
                    time.sleep(c)
            took = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if rep:  # the first is a warm-up
                times.append(took.item())
        out[f"{order}/{c}"] = times
if rank == 0:
    with open(args["out"], "w") as f:
        json.dump(out, f)
dist.destroy_process_group()
'''


def measure(rates=(20,), compute_s=(0.0, 0.02, 0.05, 0.1), reps: int = 5, mb_kib: int = 64,
            microbatches: int = 4, timeout_s: float = 300.0) -> dict:
    """Figures for ``results.json['rendezvous']``: per rate, per recv order and compute."""
    from harness.netns import NetnsCluster, netns_unavailable_reason

    if reason := netns_unavailable_reason(tunnel="veth"):
        return {"status": f"not run: {reason}"}
    result: dict = {"statistic": f"median of {reps} repeats (the slowest rank's time), ms",
                    "microbatches": microbatches, "mb_kib_per_flow": mb_kib, "flows": 2}
    for mbit in rates:
        # bare veth, as the recorded figures
        with NetnsCluster([{"slot": 2}, {"slot": 2}], start_ray=False, link_mbit=mbit,
                          tunnel="veth") as cluster, tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rdv.json"
            script = Path(tmp) / "worker.py"
            script.write_text(WORKER)
            args = json.dumps({"compute_s": list(compute_s), "reps": reps, "mb_kib": mb_kib,
                               "microbatches": microbatches, "out": str(out)})
            procs = []
            for rank in range(4):
                node = cluster.nodes[rank // 2]
                env = {**cluster.node_env(node), "RANK": str(rank), "WORLD_SIZE": "4",
                       "MASTER_ADDR": cluster.nodes[0].ip, "MASTER_PORT": "29631",
                       "GLOO_SOCKET_IFNAME": "tailscale0", "PYTHONPATH": str(REPO)}
                procs.append(subprocess.Popen(
                    [*node.exec_prefix(), sys.executable, str(script), args], env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            try:
                for p in procs:
                    p.wait(timeout=timeout_s)
            finally:
                for p in procs:
                    p.kill()
            if any(p.returncode for p in procs):
                logs = "\n".join((p.stdout.read() if p.stdout else "")[-2000:] for p in procs)
                raise RuntimeError(f"rendezvous workers failed at {mbit} Mbit/s:\n{logs}")
            raw = json.loads(out.read_text())
        send = statistics.median(raw[f"late/{compute_s[0]}"]) / microbatches
        section: dict = {"send_per_microbatch_ms": send * 1e3}
        for order in ("late", "early", "late_tp"):
            for c in compute_s:
                got = statistics.median(raw[f"{order}/{c}"])
                serial = microbatches * (send + c)
                overlapped = (microbatches * send + c if send >= c
                              else send + microbatches * c)
                # the planner's model of the 2 receivers as independent pipelines side by
                # side: each waits for its own recv, alone on the link at twice the rate
                side = max(microbatches * (send / 2 + c), overlapped)
                section[f"{order}/compute_{c * 1e3:g}ms"] = {
                    "measured_ms": got * 1e3, "serial_ms": serial * 1e3,
                    "overlapped_ms": overlapped * 1e3, "side_by_side_ms": side * 1e3}
        result[f"{mbit:g}mbit"] = section
    return result


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
