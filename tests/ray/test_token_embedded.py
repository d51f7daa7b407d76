"""The embedded ``ray-mesh run`` Ray (``runner.connect`` without an address) leaves the auth
token private: 0600 in a 0700 ``~/.ray``, although Ray itself would write it with the umask.

A real local Ray in a subprocess with its own HOME and a permissive umask (0022).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import os, ray
os.umask(0o022)
from ray_mesh.cli.runner import connect
assert connect(None, 1) is True
ray.shutdown()
"""


@pytest.mark.ray
def test_embedded_ray_token_is_private(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    env.update(HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    token = tmp_path / ".ray" / "auth_token"
    assert len(token.read_text().strip()) == 64
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
