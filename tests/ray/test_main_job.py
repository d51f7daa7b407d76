"""The README's main job, `ray-mesh run examples/hsdp.yaml`, on an embedded local Ray: it
trains, and its console reads like one: no tracebacks, no line twice, progress and a summary.

The same run, under a HOME of its own and a permissive umask (0022), holds that the embedded
Ray (``runner.connect`` without an address) leaves its auth token private: 0600 in a 0700
``~/.ray``, although Ray itself would write it with the umask. (A run of its own for that
cost ~15 s of an embedded Ray's start and stop.)"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from console import problems

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.ray

# Ray's log prefix, e.g. "(RayTrainWorker pid=504) "; its colour codes are stripped first.
PREFIX = re.compile(r"^\(\w+ pid=\d+(?:, ip=[^)]*)?\)\s?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _lines(out: str) -> list[str]:
    """The console's lines without colour and without Ray's per-process prefix."""
    return [PREFIX.sub("", ANSI.sub("", line)).rstrip() for line in out.splitlines()]


@pytest.mark.timeout(600)
def test_ray_mesh_run_hsdp_example(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    home = tmp_path / "home"  # where the embedded Ray writes its token (~/.ray/auth_token)
    home.mkdir()
    env["HOME"] = str(home)
    # Its own embedded Ray, apart from the test session's. A short path: Ray's unix socket
    # paths under it must stay below 107 bytes, which pytest's tmp_path can exceed.
    ray_tmp = tempfile.mkdtemp(prefix="rm-", dir="/tmp")
    env["RAY_TMPDIR"] = ray_tmp
    # Each of the job's reports waits for Ray Train's controller to look at the workers,
    # every 2 s by default (Ray Train passes this on to its controller); nothing printed
    # depends on it.
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "ray_mesh.cli.main", "run", "examples/hsdp.yaml"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
            umask=0o022)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = _lines(out)
    # The layout table and the interface line, once each.
    assert sum("ray_mesh: layout dp_replicate=2,dp_shard=2/fp32/sync  on" in x
               for x in lines) == 1, out[-4000:]
    assert sum(re.search(r"ray_mesh: node 0 \(.*\): ranks 0-3 use interface", x) is not None
               for x in lines) == 1, out[-4000:]
    # Progress lines: step/total, loss, rate and ETA; the loss goes down.
    progress = [x for x in lines if re.match(r"hsdp: step \d+/40 ", x)]
    assert len(progress) >= 4, out[-4000:]
    assert all("ETA" in x and "samples/s" in x for x in progress[1:]), progress
    losses = [float(re.search(r"loss ([0-9.]+)", x).group(1)) for x in progress]
    assert losses[-1] < 0.5 * losses[0], losses
    # The final summary.
    assert re.search(r"ray-mesh: run 'hsdp' finished at step 40 in [0-9.]+ s", out), out[-3000:]
    assert re.search(r"throughput: +[0-9.]+ steps/s, [0-9.]+ samples/s", out), out[-3000:]
    assert "checkpoint:" in out and "results:" in out and "metrics:" in out
    # A console a person reads: no tracebacks, nothing twice, no deprecation from our calls.
    assert "Traceback" not in out, out
    bad = problems(out)  # the checker every documented example's console goes through
    assert not bad, "unexpected console lines:\n" + "\n".join(bad[:40])
    assert "will be deprecated" not in out, out
    assert "Failed to query" not in out, out
    # Ray's default token auth, said explicitly (upstream: ray-auth-default-warning): no
    # WARNING about it on the README's main job, though the checker lets a script's own
    # ray.init() print it
    assert "Token authentication is enabled" not in out, out
    twice = {x: n for x, n in Counter(x for x in lines if x.strip()).items() if n > 1}
    assert not twice, twice
    # Verbose-only lines stay out by default.
    assert not any(x.startswith("ray_mesh rank ") for x in lines), out
    # The embedded Ray's token: private whatever the umask.
    token = home / ".ray" / "auth_token"
    assert len(token.read_text().strip()) == 64
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
