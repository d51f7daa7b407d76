"""An embedded Ray that cannot start is one ``ray-mesh: error:`` line that says what Ray said
and the way on, never Ray's traceback (seen after 6 minutes on a busy machine: "The current
node timed out during startup"). Here Ray's temp dir is a file, a real failure of a real
``ray.init``, so the test starts no Ray process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_an_embedded_ray_that_cannot_start_is_one_line_with_the_fix(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "RAY_TMPDIR": str(blocker / "ray")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "ray_mesh.cli", "run",
                           str(REPO / "examples" / "hsdp.yaml")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    errors = [ln for ln in out.splitlines() if ln.startswith("ray-mesh: error:")]
    assert len(errors) == 1 and "Traceback" not in out, out
    assert "the embedded local Ray did not start" in errors[0], errors
    assert "NotADirectoryError" in errors[0] and "--address" in errors[0], errors
