"""Heavy tests one at a time (tests/helpers/heavy.py): the lock, its bounded wait and the
journal's overlap check, with real processes and a real flock."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import heavy

HELPERS = Path(__file__).resolve().parents[1] / "helpers"

HOLD = """
import sys, time
sys.path.insert(0, {helpers!r})
import heavy
from pathlib import Path
with heavy.alone({nodeid!r}, Path({journal!r}), wait_s={wait_s}, lock=Path({lock!r})):
    time.sleep({hold_s})
"""


def _hold(tmp_path: Path, nodeid: str, hold_s: float, wait_s: float = 60) -> subprocess.Popen:
    code = HOLD.format(helpers=str(HELPERS), nodeid=nodeid, journal=str(tmp_path / "j.jsonl"),
                       wait_s=wait_s, lock=str(tmp_path / "lock"), hold_s=hold_s)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _entry(nodeid: str, start: float, end: float) -> dict:
    return {"pid": 1, "nodeid": nodeid, "start": start, "end": end}


def test_overlaps_names_every_overlapping_pair_and_no_other():
    entries = [_entry("a", 0, 10), _entry("b", 10, 20), _entry("c", 15, 16),
               _entry("d", 19, 30), _entry("e", 30, 31)]
    pairs = [(x["nodeid"], y["nodeid"]) for x, y in heavy.overlaps(entries)]
    assert pairs == [("b", "c"), ("b", "d")]  # touching ends (a/b, d/e) do not overlap
    assert heavy.overlaps([_entry("a", 0, 1), _entry("b", 1, 2)]) == []
    assert "b (pid 1, 10.0-20.0) and c (pid 1, 15.0-16.0)" in heavy.describe(
        heavy.overlaps(entries))


def test_two_processes_take_turns_and_the_journal_shows_no_overlap(tmp_path):
    began = time.monotonic()
    procs = [_hold(tmp_path, f"t{i}", hold_s=1.5) for i in range(2)]
    for proc in procs:
        assert proc.wait(timeout=60) == 0, proc.stdout.read()
    entries = heavy.read(tmp_path / "j.jsonl")
    assert sorted(e["nodeid"] for e in entries) == ["t0", "t1"]
    assert heavy.overlaps(entries) == []
    assert time.monotonic() - began >= 3.0  # one after the other, not side by side


def test_a_wait_past_its_bound_runs_anyway_says_so_and_is_caught_as_an_overlap(tmp_path):
    first = _hold(tmp_path, "holder", hold_s=8)
    deadline = time.monotonic() + 30
    while not heavy.holder(tmp_path / "lock").endswith("holder"):
        assert time.monotonic() < deadline, "the first process never took the lock"
        time.sleep(0.1)
    second = _hold(tmp_path, "late", hold_s=0.1, wait_s=1)
    out = second.communicate(timeout=60)[0]
    assert second.returncode == 0, out
    assert "still held after 1 s by pid" in out and "holder" in out, out
    assert first.wait(timeout=60) == 0
    pairs = heavy.overlaps(heavy.read(tmp_path / "j.jsonl"))
    assert [(a["nodeid"], b["nodeid"]) for a, b in pairs] == [("holder", "late")]
