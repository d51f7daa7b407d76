"""Launch ranks for tests/dist: a script under ``torchrun`` on loopback with a fresh rendezvous
port, or a function on spawned processes, each bounded in time.

One launcher for every torchrun test: the environment is the test's own minus any inherited
rank variables (a test run under torchrun itself must not leak them), with the repository on
``PYTHONPATH`` so the children import this checkout of ray_mesh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path | str, *args: str, nproc: int = 4, cwd: Path | str | None = None,
             timeout: float = 360, env: dict[str, str | None] | None = None
             ) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` on ``nproc`` local ranks; returns the finished process (text).

    ``env`` adds variables to the test's environment; a value of None removes one.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    for key, value in (env or {}).items():
        if value is None:
            base.pop(key, None)
        else:
            base[key] = value
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args],
        cwd=cwd, env=base, capture_output=True, text=True, timeout=timeout)


def assert_checks(proc: subprocess.CompletedProcess[str], checks: list[str]) -> None:
    """Exit 0, a ``PASS <name>`` line for every check, and ``ALL_DONE``."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for name in checks:
        assert f"PASS {name}" in proc.stdout, (name, out[-6000:])
    assert "ALL_DONE" in proc.stdout, out[-6000:]


def spawn_ranks(worker: Callable[..., None], args: tuple, nprocs: int, timeout_s: float,
                what: str) -> None:
    """Spawn ``worker(rank, *args)`` on ``nprocs`` processes; kill them all and fail the test
    (naming ``what``) if they have not finished within ``timeout_s``: never a hung suite."""
    import pytest
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish in {timeout_s:.0f} s")
