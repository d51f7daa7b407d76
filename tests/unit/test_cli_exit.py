"""The ``ray-mesh`` process ends without a last garbage collection over everything torch and
Ray loaded (``ray_mesh.cli.main.script``: ``gc.freeze()`` after the command; ~0.9 s of CPU
per command on a 2-core machine), while ``main`` -- what in-process callers use -- leaves
the caller's collector alone."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import gc, sys
from ray_mesh.cli.main import {fn}
code = {fn}(["storage", "key", "--key-file", sys.argv[1]])
print("FROZEN", gc.get_freeze_count() > 0, "CODE", code)
"""


def _probe(fn: str, tmp_path: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", PROBE.format(fn=fn),
                          str(tmp_path / f"{fn}.env")], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_the_process_entry_freezes_the_collector_after_the_command(tmp_path):
    assert "FROZEN True CODE 0" in _probe("script", tmp_path)


def test_main_leaves_the_callers_collector_alone(tmp_path):
    assert "FROZEN False CODE 0" in _probe("main", tmp_path)
    assert gc.get_freeze_count() == 0  # nor did anything in this process freeze it


def test_every_process_entry_goes_through_script():
    assert "script(argv)" in (ROOT / "ray_mesh/cli/__init__.py").read_text()
    assert "sys.exit(script())" in (ROOT / "ray_mesh/cli/__main__.py").read_text()
    assert "sys.exit(script())" in (ROOT / "ray_mesh/cli/main.py").read_text()
