"""harness/replica_check.py's sample accounting: a group killed between the average that took
its samples and its own log line is credited from the survivors' rows, and only then.

Seen in benchmarks/user_job.py's run with the laptop dropped three times: the survivors
committed step 5 with 3 contributors, the laptop's process died before its rank 0 wrote
the step, and its 2 samples were counted skipped although they trained the model."""

from __future__ import annotations

import json
from pathlib import Path

from harness import replica_check as rc


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _run(tmp_path: Path, contributors: int) -> Path:
    """Steps 4 to 6 (samples 0-55); group 2 logged step 4, held step 5 and died."""
    rows = {0: [([0, 16], 3), ([24, 18], contributors), ([48, 8], 2)],
            1: [([16, 6], 3), ([42, 4], contributors)]}
    for gid, steps in rows.items():
        _write(tmp_path / f"g{gid}.jsonl", [
            {"step": 4 + k, "ranges": [r], "groups": 3, "contributors": c, "t": float(k)}
            for k, (r, c) in enumerate(steps)])
    _write(tmp_path / "g2.jsonl", [{"step": 4, "ranges": [[22, 2]], "groups": 3,
                                    "contributors": 3, "t": 0.0}])
    _write(tmp_path / "g2.held.jsonl", [{"step": 4, "ranges": [[22, 2]], "attempt": "a"},
                                        {"step": 5, "ranges": [[46, 2]], "attempt": "a"}])
    return tmp_path


def test_a_group_the_survivors_averaged_is_credited(tmp_path):
    used = rc.read_used(_run(tmp_path, contributors=3))
    assert [r for r in used[2] if r.get("credited")] == [
        {"step": 5, "ranges": [[46, 2]], "attempt": "a", "credited": True}]
    assert rc.sample_use(used) == ([], [])
    assert rc.sample_use(rc.read(tmp_path)) == ([], [46, 47])  # the log alone


def test_a_group_the_survivors_did_not_count_is_not_credited(tmp_path):
    used = rc.read_used(_run(tmp_path, contributors=2))
    assert not any(r.get("credited") for rows in used.values() for r in rows)
    assert rc.sample_use(used) == ([], [46, 47])


def test_the_held_log_is_not_read_as_committed_steps(tmp_path):
    """``g2.held.jsonl`` matches a ``g*.jsonl`` glob: read as committed steps it moved the
    lab's kill before the step it names (top_step saw step 5 held, not committed) and broke
    the user-job benchmark's drop schedule (its rows have no time: KeyError 't')."""
    log = _run(tmp_path, contributors=3)
    assert rc.top_step(log) == 6  # group 0's step 6; group 2 held 5 and committed 4
    assert [r["step"] for r in rc.read(log)[2]] == [4]
    (log / "g3.held.jsonl").write_text(json.dumps({"step": 9, "ranges": [], "attempt": "b"})
                                       + "\n")  # a group that never committed a step
    assert rc.top_step(log) == 6 and 3 not in rc.read(log)
