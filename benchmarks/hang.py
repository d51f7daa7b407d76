"""Cost and speed of the hang watch (``ray_mesh.observability.hang``), under torchrun.

    python benchmarks/hang.py [--rounds 10] [--steps 30] [--results benchmarks/results.json]

* overhead: a toy dp_shard=2 x tp=2 step (MLP forward/backward, grads all-reduced on dp
  through ``hang.all_reduce``, one plain tp all_reduce), watch on vs off in alternating
  windows; the median of the per-round ratios. Also the per-call cost of the watched
  context around a 1-element all_reduce, and the watchdog thread's work per poll (once a
  second). Target: < 1% of a step.
* detect_hang_s: the scenario of tests/dist/test_hang_torchrun.py (rank 3 skips a dp
  all_reduce and sleeps), one run: seconds from rank 3 skipping to the first rank holding
  the report. It is hang_timeout_s plus the detection latency (up to one poll, 1 s).

Merges an ``observability`` section into the results JSON, keeping every other key.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HANG_TIMEOUT_S = 10.0


def _torchrun(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4",
                           "--standalone", str(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def overhead(rounds: int, steps: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix="rmbench_hang_")) / "overhead.json"
    proc = _torchrun(REPO / "benchmarks" / "_hang_worker.py", str(out), str(rounds),
                     str(steps), timeout=1200)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(out.read_text())


def detect() -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="rmbench_hang_"))
    config = {"hang_timeout_s": HANG_TIMEOUT_S, "skip_step": 3, "skip_rank": 3,
              "out_dir": str(tmp), "sleep_s": 120}
    start = time.monotonic()
    _torchrun(REPO / "harness" / "hang_train.py", json.dumps(config), timeout=300)
    ended = time.monotonic() - start
    t0 = json.loads((tmp / "hang_start.json").read_text())["t"]
    seen = sorted(json.loads(p.read_text())["t"] - t0 for p in tmp.glob("report_*.json"))
    return {"detect_hang_s": round(seen[0], 2),
            "detect_hang_statistic": "one run: rank 3 skips -> first rank holds the report",
            "detect_hang_all_ranks_s": [round(s, 2) for s in seen],
            "hang_timeout_s": HANG_TIMEOUT_S, "torchrun_wall_s": round(ended, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results.json"))
    args = p.parse_args(argv)
    section = {**overhead(args.rounds, args.steps), **detect(),
               "loadavg": os.getloadavg(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime())}
    section["watched_context_share_of_step"] = (
        4 * section["watched_context_s"] / section["step_plain_s"])  # 4 watched calls/step
    section["watchdog_share_of_time"] = section["watchdog_tick_s"] / section["watchdog_poll_s"]
    section["note"] = ("A/B step ratio is noise on a loaded 2-core VM (see loadavg); the "
                       "bound is the per-call context cost and the watchdog's tick per poll.")
    path = Path(args.results)
    results = json.loads(path.read_text()) if path.exists() else {}
    results["observability"] = {**results.get("observability", {}), **section}
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(section, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
