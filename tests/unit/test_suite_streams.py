"""The suite's own machinery, run on a small copy of it: the unit tests beside the heavy kinds
in a child whose reports join the session (tests/helpers/streams.py), and the overlap check
of the heavy tests' journal (tests/helpers/heavy.py, tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

UNIT = '''
import os
import pytest

def test_passes():
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"unit {os.getpid()}\\n")

def test_fails():
    assert 1 == 2, "a unit failure reaches the parent"

def test_skips():
    pytest.skip("a unit skip reaches the parent's summary")
'''
HEAVY = '''
import os, time

def test_heavy_{n}():
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"heavy {{os.getpid()}}\\n")
    time.sleep(float(os.environ.get("HEAVY_S", "0")))
'''


def _tree(root: Path) -> Path:
    """tests/ with the real conftest and helpers, two unit files and two heavy ones."""
    (root / "tests" / "helpers").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", root / "tests" / "conftest.py")
    for name in ("heavy.py", "streams.py", "require_all.py"):
        shutil.copy(TESTS / "helpers" / name, root / "tests" / "helpers" / name)
    for kind in ("unit", "dist"):
        (root / "tests" / kind).mkdir()
    (root / "tests" / "unit" / "test_a.py").write_text(UNIT)
    (root / "tests" / "unit" / "test_b.py").write_text("def test_b():\n    pass\n")
    for n in (1, 2):
        (root / "tests" / "dist" / f"test_h{n}.py").write_text(HEAVY.format(n=n))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "RAY_MESH_REQUIRE_ALL", "RAY_MESH_HEAVY_JOURNAL",
                        "RAY_MESH_UNIT_STREAM", "PYTEST_ADDOPTS")}
    # A lock of its own (beside PIDS): the machine-wide one is held by the outer suite's heavy
    # test while this unit test runs beside it, and the copy's heavy tests would wait 900 s.
    lock = str(Path(extra["PIDS"]).parent / "heavy.lock")
    return {**env, "RAY_MESH_HEAVY_LOCK": lock, **extra}


def test_the_unit_stream_joins_one_console_one_closing_line_and_one_exit_code(tmp_path):
    root = _tree(tmp_path)
    pids = tmp_path / "pids"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
                          cwd=root, capture_output=True, text=True, timeout=180,
                          env=_env(PIDS=str(pids)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "collected 6 items" in out, out
    assert "1 failed, 4 passed, 1 skipped" in out, out
    assert "FAILED tests/unit/test_a.py::test_fails" in out, out
    assert "a unit skip reaches the parent's summary" in out, out
    assert "%]" in out and not any(f"[{n}%]" in out for n in range(101, 1000)), out
    assert "time by kind (setup + call + teardown): unit" in out, out
    ran = dict(line.split() for line in pids.read_text().splitlines())
    assert ran["unit"] != ran["heavy"], ran  # the unit tests ran in a process of their own


def test_two_sessions_whose_heavy_tests_overlap_fail_naming_them(tmp_path):
    """Two whole-suite sessions at once on one journal, the lock's wait cut to 0.2 s: the
    second runs its heavy tests anyway, and the overlap check names the pairs."""
    root = _tree(tmp_path)
    env = _env(RAY_MESH_HEAVY_JOURNAL=str(tmp_path / "journal.jsonl"),
               RAY_MESH_HEAVY_WAIT_S="0.2", RAY_MESH_HEAVY_LOCK=str(tmp_path / "lock"),
               HEAVY_S="2", RAY_MESH_UNIT_STREAM="0", PIDS=str(tmp_path / "pids"))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-k", "heavy"]
    first = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env)
    second = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env)
    outs = [p.communicate(timeout=180)[0] for p in (first, second)]
    joined = "\n".join(outs)
    assert "heavy_tests_run_one_at_a_time" in joined, joined
    assert "overlapped in time" in joined and "tests/dist/test_h" in joined, joined
    assert "running anyway" in joined, joined
    assert 1 in (first.returncode, second.returncode), joined


def test_a_warning_in_either_process_fails_the_run_naming_it(tmp_path):
    """A warning is a defect (tests/conftest.py): one raised by a unit test (in the unit
    stream's child) and one by a heavy test (in the parent) each fail the run by name."""
    root = _tree(tmp_path)
    (root / "tests" / "unit" / "test_b.py").write_text(
        "import warnings\n\ndef test_b():\n    warnings.warn('unit stream warning')\n")
    heavy = root / "tests" / "dist" / "test_h2.py"
    heavy.write_text(heavy.read_text() + "    import warnings\n"
                     "    warnings.warn('heavy warning', DeprecationWarning)\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider"],
                          cwd=root, capture_output=True, text=True, timeout=180,
                          env=_env(PIDS=str(tmp_path / "pids")))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    failed = [x for x in out.splitlines() if x.startswith("FAILED tests/conftest.py::no_warn")]
    assert len(failed) == 2, out
    assert "test_b.py::test_b: UserWarning: unit stream warning" in out, out
    assert "test_h2.py::test_heavy_2: DeprecationWarning: heavy warning" in out, out
