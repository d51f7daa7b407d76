"""A busy head: Ray's state API answers, slowly. Run tracking must stay on and say so.

tests/helpers/_busy_head_driver.py runs in a subprocess (it starts its own local Ray with
the dashboard; the session's shared Ray has none): a real Ray, a real dashboard, a real
``MeshConfig`` fit; the only addition is a proxy that holds each state API request 5 s
before forwarding it to the real dashboard, on the address the driver's probe asks. Before
the fix, the 3 s probe's timeout turned run-state tracking off with "no dashboard: install
ray[default]", and ``ray-mesh status`` never listed the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
REPO = HELPERS.parents[1]


def test_a_slow_state_api_keeps_the_run_tracked_and_listed_by_status():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HELPERS)]),
           "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_TRAIN_ENABLE_STATE_TRACKING", None)
    env.pop("RAY_API_SERVER_ADDRESS", None)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(HELPERS / "_busy_head_driver.py")], env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    result = next((json.loads(line[len("RESULT "):]) for line in out.splitlines()
                   if line.startswith("RESULT ")), None)
    assert proc.returncode == 0 and result is not None, out[-4000:]
    lines = result["lines"]
    assert result["tracking_env"] == "1", lines
    assert result["proxy_hits"] >= 2, result  # the probe went through the slow proxy
    slow = [m for m in lines if "slow to answer" in m]
    assert len(slow) == 1 and "tracking stays on" in slow[0], lines
    assert not any("install ray[default]" in m or "no dashboard" in m for m in lines), lines
    assert any("answers now" in m for m in lines), lines  # the background retry caught up
    assert {"name": "busyhead", "status": "FINISHED"} in result["runs"], result
