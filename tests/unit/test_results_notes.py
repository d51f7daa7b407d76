"""benchmarks/RESULTS.md keeps its hand-written notes when run.py --results-md rewrites it.

The figures the manual points to (pooled step ratios, the per-layout slow-link table, the
DiLoCo table) sit below the generated table; a rewrite that dropped them would lose them
silently on the next benchmark run.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import report

REPO = Path(__file__).resolve().parents[2]


def _results() -> dict:
    machine = {"nproc": 2, "mem_gib": 23.5, "platform": "Linux", "python": "3.11",
               "torch": "2.13.0", "ray": "2.60.0", "loadavg_start": (1.0, 1.0, 1.0),
               "loadavg_end": (2.0, 2.0, 2.0), "free_g": "Mem: 23"}
    return {"machine": machine, "started": "T0", "finished": "T1", "quick": False,
            "command": "python benchmarks/run.py --only x"}


def test_rewrite_keeps_the_notes_and_replaces_the_table(tmp_path):
    path = tmp_path / "RESULTS.md"
    notes = f"{report.NOTES_MARK}\n\n# Notes\n\nhand-written figure 0.99 (median of 45)\n"
    path.write_text("# old table\n| a | old | 1 | |\n\n" + notes)
    report.write_markdown(path, _results(), [("a", "new figure", "2", "")])
    text = path.read_text()
    assert "| a | new figure | 2 |  |" in text and "old table" not in text
    assert text.endswith(notes), text
    assert text.count(report.NOTES_MARK) == 1


def test_a_file_without_notes_gets_none(tmp_path):
    path = tmp_path / "RESULTS.md"
    report.write_markdown(path, _results(), [("a", "b", "c", "d")])
    assert report.NOTES_MARK not in path.read_text()


def test_the_committed_results_carry_the_mark():
    assert report.NOTES_MARK in (REPO / "benchmarks" / "RESULTS.md").read_text()
