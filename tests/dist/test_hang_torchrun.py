"""The hang watch under torchrun (no Ray): rank 3 skips a dp all_reduce and sleeps."""

from __future__ import annotations

import json
import time
from pathlib import Path

from torchrun import torchrun

HELPER = Path(__file__).resolve().parents[2] / "harness" / "hang_train.py"
HANG_TIMEOUT_S = 6.0
# The waiting ranks' collectives end at this process-group timeout (the watch's default,
# hang_timeout_s + 15 s, only waits longer): after detection (within a few polls of the
# bound) and the report, which every rank that saw the hang waits for (HangWatch.explain).
PG_TIMEOUT_S = HANG_TIMEOUT_S + 7.0


def test_skipped_collective_is_named_with_stacks(tmp_path):
    config = {"hang_timeout_s": HANG_TIMEOUT_S, "skip_step": 3, "skip_rank": 3,
              "out_dir": str(tmp_path), "sleep_s": 300, "pg_timeout_s": PG_TIMEOUT_S}
    start = time.monotonic()
    proc = torchrun(HELPER, json.dumps(config), timeout=HANG_TIMEOUT_S + 120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, "a hung run must fail, not finish"
    # Bound: the hang starts after bring-up (a few s); the run ends at the process-group
    # timeout (PG_TIMEOUT_S) plus torchrun's teardown.
    assert elapsed < HANG_TIMEOUT_S + 60, elapsed
    assert "ray_mesh: collective hang" in proc.stderr
    # The waiting rank's error is the report, not gloo's bare timeout.
    report = (tmp_path / "error_1.txt").read_text()
    assert report.startswith("ray_mesh: collective hang")
    lines = report.splitlines()
    cause = next(ln for ln in lines if "on mesh dim 'dp_shard'" in ln)
    assert "all_reduce #4 on mesh dim 'dp_shard' (same group as dp" in cause, report
    assert lines.index(cause) <= 3, report  # a cause, listed before the knock-on tp stall
    assert "group ranks [1, 3]" in cause and "waiting rank 1" in cause, cause
    assert "did not arrive: rank 3 (at #3)" in cause, cause
    assert f"process-group timeout ({PG_TIMEOUT_S:g} s)" in report, report
    assert any("rank 3" in ln and "NOT in any collective" in ln for ln in lines), report
    # Rank 3's Python stack shows where it is: the user's function, in time.sleep.
    rank3 = report.split("--- rank 3", 1)[1]
    assert "in stuck_in_user_code" in rank3 and "time.sleep(seconds)" in rank3
    rank1 = report.split("--- rank 1", 1)[1].split("--- rank 2", 1)[0]
    assert "hang.all_reduce(t, \"dp\")" in rank1 and "in all_reduce" in rank1
    # Every rank got the report; detection came after the bound, not before.
    start_t = json.loads((tmp_path / "hang_start.json").read_text())["t"]
    seen = [json.loads((tmp_path / f"report_{r}.json").read_text())["t"] - start_t
            for r in range(4)]
    assert min(seen) >= HANG_TIMEOUT_S, seen
