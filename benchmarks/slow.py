"""The slow rank / slow link verdict: how fast it comes, and what the wait sampler costs.

    python benchmarks/slow.py [--rounds 10] [--steps 30] [--skip-detect]
    python benchmarks/run.py --only slow

* overhead (torchrun, 4 ranks, no Ray): a toy HSDP step (dp_replicate=2 x dp_shard=2,
  plain ``dist.all_reduce``), the wait sampler (``ray_mesh.observability.waits``) on vs off
  in alternating windows; statistic ``sampled_over_plain_median_of_rounds``: the median
  over rounds of (median step with / median step without). On a loaded 2-core VM that
  ratio is noise of a few %, so the bound is also given: ``sampler_share_of_time``, the
  sampler's work per sample over its interval: the share of one core (and of the GIL) it
  takes. The work is the larger of two measures: 2000 samples with a second thread waiting
  outside torch, and 500 samples while the training thread is blocked in an all_reduce (a
  late rank), where each sample also reads that frame's locals to name the group.
* detect_slow_link_s / detect_slow_rank_s (the netns virtual cluster, root): 2 nodes x 2
  workers, HSDP, as tests/netns/test_slow_netns.py: node 1's link shaped to 20 Mbit/s (1000
  elsewhere), then the link back at 1000 and rank 3 spinning 0.15 s per step. Statistic:
  one run each, seconds from rank 0 entering the train function to the first
  ``ray_mesh.status.cluster.collect()`` (what ``ray-mesh status --json`` prints)
  whose verdict names the link / the rank, asked every 2 s. Target: 60 s.

Merges keys into ``observability`` of the results JSON, keeping every other key.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 180.0


def overhead(rounds: int, steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="rmbench_slow_")) / "overhead.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
                           "--standalone", str(REPO / "benchmarks" / "_slow_worker.py"),
                           str(out), str(rounds), str(steps)], capture_output=True, text=True,
                          timeout=1200, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(out.read_text())


def detect() -> dict:
    from harness.netns import NetnsCluster, netns_unavailable_reason
    from harness.slow_driver import run_in_cluster

    if reason := netns_unavailable_reason(tunnel="veth"):
        return {"detect_status": f"not run: {reason}"}
    out: dict = {}
    storage = tempfile.mkdtemp(prefix="rmbench_slow_")
    with NetnsCluster([{"slot": 2}, {"slot": 2}], dashboard=True, link_mbit=1000,
                      node_mbit={1: 20}, start_attempts=3,
                      tunnel="veth") as cluster:  # bare veth, as the recorded figures
        for key, config, rate in (
                ("link", {"name": "benchlink", "expect": "link"}, None),
                ("rank", {"name": "benchrank", "expect": "rank", "slow_rank": 3,
                          "busy_s": 0.15}, 1000)):
            if rate:
                cluster.shape_link(1, rate)
            res = run_in_cluster(cluster, {**config, "storage": storage}, DEADLINE_S)
            slow = (res.get("run") or {}).get("slow") or {}
            out[f"detect_slow_{key}_s"] = res.get("detect_s") if res.get("found") else None
            out[f"detect_slow_{key}_verdict"] = res.get("verdict")
            out[f"detect_slow_{key}_links"] = slow.get("links")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip-detect", action="store_true", help="overhead only (no root needed)")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.json"))
    args = p.parse_args(argv)
    section = measure(args.rounds, args.steps, not args.skip_detect)
    merge(Path(args.results), section)
    print(json.dumps(section, indent=1))
    return 0


def measure(rounds: int = 10, steps: int = 30, detect_too: bool = True) -> dict:
    """Every figure, under the ``observability`` keys they are recorded with."""
    cost = overhead(rounds, steps)
    section = {"wait_sampler_overhead": cost["sampled_over_plain_median_of_rounds"] - 1,
               "wait_sampler_share_of_time": cost["sampler_share_of_time"],
               "wait_sampler_detail": {**cost, "statistic": (
                   "wait_sampler_overhead: median over rounds of median step time with the "
                   "sampler / without - 1 (alternating windows; noisy on a loaded host); "
                   "wait_sampler_share_of_time: cost of one sample (the larger of: 2000 "
                   "samples beside a thread waiting outside torch; 500 samples while the "
                   "training thread is blocked in an all_reduce) / sampling interval: what "
                   "the sampler takes from a step, the bound to read when the A/B ratio is "
                   "noise")}}
    if detect_too:
        try:
            section.update(detect())
            section["detect_slow_when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        except Exception:  # noqa: BLE001 - keep the overhead figures; run.py flags the status
            section["detect"] = {"status": f"failed: {traceback.format_exc()}"[-3000:]}
        section["detect_slow_link_statistic"] = (
            "one run on the netns cluster (2 nodes x 2 workers, HSDP, node 1 at 20 Mbit/s, "
            "1000 elsewhere): seconds from rank 0 entering the train function to the first "
            "status collect() (asked every 2 s) whose verdict names the link; "
            "detect_slow_rank_s: the same with links at 1000 and rank 3 spinning 0.15 s/step")
    section["slow_loadavg"] = os.getloadavg()
    section["slow_when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return section


def merge(path: Path, section: dict) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    obs = {**results.get("observability", {}), **section}
    if obs.get("detect_slow_link_s") is not None:
        obs.pop("detect_slow_link_s_note", None)
    results["observability"] = obs
    if isinstance(results.get("slow"), dict):  # run.py's section: the same figures
        results["slow"].update(section)
    path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
