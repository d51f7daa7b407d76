"""CI must not pass on a partly skipped suite: tests/helpers/require_all.py and .ci/run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]

SAMPLE = '''
import pytest

def test_runs():
    pass

def test_needs_a_tool():
    pytest.skip("widget is not installed (apt-get install -y widget)")

@pytest.mark.slow
@pytest.mark.skip(reason="slow scenario: opt in")
def test_slow_opt_in():
    pass
'''


def _pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CI", "RAY_MESH_REQUIRE_ALL", "RAY_MESH_SLOW_TESTS")}
    clean["PYTHONPATH"] = str(REPO / "tests" / "helpers")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "require_all", "-p", "no:cacheprovider",
         "-c", os.devnull, "--rootdir", str(tmp_path), "-rfEs", "-W", "ignore",
         str(tmp_path / "test_sample.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**clean, **env})


def test_a_skip_fails_in_ci_naming_what_is_missing(tmp_path):
    for env in ({"CI": "true"}, {"RAY_MESH_REQUIRE_ALL": "1"}):
        proc = _pytest(tmp_path, **env)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out
        assert "1 passed" in out and "1 skipped" in out, out  # the slow opt-in stays a skip
        assert "test_needs_a_tool was skipped (widget is not installed (apt-get install -y " \
               "widget))" in out, out
        assert "must run every test" in out


def test_outside_ci_a_skip_is_a_skip_and_is_listed(tmp_path):
    proc = _pytest(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 2 skipped" in out, out
    assert "SKIPPED [1]" in out and "widget is not installed" in out  # the -rs report


def test_the_suite_reports_skips_and_ci_requires_everything():
    addopts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"].split()
    assert any(o.startswith("-r") and "s" in o for o in addopts), addopts
    ci = (REPO / ".ci" / "run").read_text()
    assert "RAY_MESH_REQUIRE_ALL=1" in ci
    # pytest's own exit code ends the script: 5 (nothing collected) fails CI like 1 does.
    assert "set -euo pipefail" in ci and "|| true" not in ci and "exit 0" not in ci
    assert ci.rstrip().splitlines()[-1].endswith("python -m pytest")
    for pkg in ("shellcheck", "iproute2", "chromium", "nftables", "iptables"):
        assert pkg in ci, pkg
    # only what the tests need: a recommended kernel image and initramfs cost CI minutes
    installs = [ln for ln in ci.splitlines() if "apt-get install" in ln]
    assert installs and all("--no-install-recommends" in ln for ln in installs), installs
    readme = (REPO / "README.md").read_text()
    test_cmd = next(ln for ln in ci.splitlines() if "python -m pytest" in ln)
    # .ci/run is the README's test command (plus the installs and the CI switch).
    assert test_cmd.split("RAY_MESH_REQUIRE_ALL=1 ")[-1] in readme, test_cmd
