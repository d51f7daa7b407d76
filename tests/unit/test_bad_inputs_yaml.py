"""YAML that costs far more than its size: refused in one line, in seconds, in bounded memory.

A 450-byte "billion laughs" job file (nine lines of ten aliases) used to take ``ray-mesh
plan`` past 3.8 GB and 90 s without an answer, and ``ray-mesh run`` to a ``MemoryError``
traceback after 37 s (3.8 GiB address-space limit); a 20,000-deep file gave a
``RecursionError`` traceback. Here each runs through the real command in its own
interpreter (``python -m ray_mesh.cli``), and the child's peak memory is read from the
kernel (``wait4``): the bound is what importing torch and the CLI costs plus a margin.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_mesh.cli.job import Job, JobError
from ray_mesh.core.yaml_load import MAX_DEPTH, load_yaml

ROOT = Path(__file__).resolve().parents[2]
PEAK_MB = 1500  # the CLI with torch imported is ~320-430 MB here
WITHIN_S = 30.0  # a hang guard on a shared 2-core box; the refusal itself takes ~1 s


def billion_laughs(tail: str) -> str:
    """Nine anchored lists of ten aliases each (10**9 "lol"s), under ``config:``."""
    lines = ["config:", '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"  {name}: &{name} [" + ",".join([f"*{prev}"] * 10) + "]")
    return "\n".join(lines) + "\n" + tail


LAUGHS = {
    "plan": billion_laughs("train: t.py:f\nplan: {model: *i, tokens_per_step: 1, "
                           "compute_s: 1}\n"),
    "run": billion_laughs("train: t.py:f\nscaling: {resources_per_worker: *i}\n"),
}


def _cli(args: list[str], cwd: Path) -> tuple[int, str, float, float]:
    """(exit status, output, seconds, peak resident MB) of ``python -m ray_mesh.cli``."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out = cwd / "out.txt"
    t0 = time.monotonic()
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "ray_mesh.cli", *args], cwd=cwd,
                                env=env, stdout=sink, stderr=subprocess.STDOUT)
        deadline = t0 + WITHIN_S * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return proc.returncode, out.read_text(), time.monotonic() - t0, usage.ru_maxrss / 1024


@pytest.mark.parametrize("command", ["plan", "run"])
def test_billion_laughs_is_one_line_in_seconds_and_bounded_memory(tmp_path, command):
    (tmp_path / "t.py").write_text("def f(config):\n    pass\n")
    job = tmp_path / "laughs.yaml"
    job.write_text(LAUGHS[command])
    assert len(job.read_bytes()) < 700
    code, out, took, peak_mb = _cli([command, str(job)], tmp_path)
    lines = out.strip().splitlines()
    assert code == 2, (code, took, out[-2000:])
    assert len(lines) == 1 and lines[0].startswith("ray-mesh: error: "), out[-2000:]
    assert "more than 100,000 values" in lines[0] and "aliases" in lines[0], lines[0]
    assert "laughs.yaml is refused at line 6" in lines[0], lines[0]  # where it passes 100k
    assert peak_mb < PEAK_MB, f"{peak_mb:.0f} MB"


@pytest.mark.parametrize("text, says", [
    ("train: t.py:f\nconfig: " + "[" * 20_000 + "]" * 20_000 + "\n",
     f"nests deeper than {MAX_DEPTH} levels"),
    ("train: t.py:f\nconfig: {seed: " + "9" * 5000 + "}\n", "an integer of 5000 characters"),
    ("train: t.py:f\nname: 0x" + "f" * 5000 + "\n", "an integer of 5002 characters"),
    ("train: t.py:f\nconfig: {a: &a [1, 2]}\nscaling: *a\n", "'scaling' must be a mapping"),
    ("train: t.py:f\n" + "# pad\n" * 200_000, "larger than 1 MiB"),
], ids=["deep", "digits", "hex-digits", "small-alias-still-works", "oversized"])
def test_the_loader_bounds_depth_integers_and_size(tmp_path, text, says):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    t0 = time.monotonic()
    with pytest.raises(JobError) as err:
        Job.from_yaml(path)
    assert says in str(err.value) and len(str(err.value)) < 400, str(err.value)[:500]
    assert time.monotonic() - t0 < 10


def test_ordinary_anchors_and_merges_still_load():
    doc = load_yaml("base: &b {steps: 4, lr: 0.1}\nconfig:\n  <<: *b\n  lr: 0.2\n"
                    "big: 12345678901234567890\n")
    assert doc["config"] == {"steps": 4, "lr": 0.2} and doc["big"] == 12345678901234567890
