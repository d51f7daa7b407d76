"""``deploy/tailscale/firewall.sh peers`` against a real Ray cluster: it prints the live nodes'
addresses, and that list, saved as the peers file, is what the firewall admits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

FIREWALL = Path(__file__).resolve().parents[2] / "deploy" / "tailscale" / "firewall.sh"


def test_peers_lists_the_ray_nodes(ray_local, tmp_path):
    ray = ray_local
    address = ray.get_runtime_context().gcs_address
    alive = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
    env = {**os.environ, "RAY_MESH_PYTHON": sys.executable}
    p = subprocess.run(["bash", str(FIREWALL), "peers", address], capture_output=True,
                       text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == alive, (p.stdout, alive)
    peers = tmp_path / "peers"
    peers.write_text(p.stdout)
    rules = subprocess.run(["bash", str(FIREWALL), "print"], capture_output=True, text=True,
                           timeout=60, env={**env, "RAY_MESH_FW_PEERS_FILE": str(peers),
                                            "RAY_MESH_FW_BACKEND": "nft"})
    if rules.returncode != 0 and "not installed" in rules.stderr:
        pytest.skip("nft is not installed")
    assert rules.returncode == 0, rules.stderr
    assert f"ip saddr {{ {', '.join(alive)} }} accept" in rules.stdout, rules.stdout
    # A cluster that does not answer: the fix, not a traceback.
    p = subprocess.run(["bash", str(FIREWALL), "peers", "127.0.0.1:1"], capture_output=True,
                       text=True, env=env, timeout=180)
    assert p.returncode == 2 and "could not list the Ray nodes" in p.stderr, p.stderr[-2000:]
