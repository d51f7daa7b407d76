"""The cluster's auth token is private: 0600 in a 0700 directory, wherever ray_mesh makes it.

Scripts run with a permissive umask (0022) and a stand-in ``ray`` that writes the token the
way Ray does (a plain write, so with the umask); the real ``ray get-auth-token --generate``
runs too when the ``ray`` command is installed. The Python path (embedded ``ray-mesh run``)
goes through ``ray_mesh.raytrain.auth.secure_token_file``.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from ray_mesh.raytrain import auth

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "tailscale"
FAKE_RAY = """#!/usr/bin/env bash
if [[ "$1" == get-auth-token ]]; then
    mkdir -p "$HOME/.ray"
    printf 'aaaabbbbccccdddd' > "$HOME/.ray/auth_token"
    exit 0
fi
echo "ray $*"
"""


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _run(tmp_path: Path, script: str, *args: str, ray: str | None = FAKE_RAY,
         home_ray_mode: int | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = f"{bin_dir}:/usr/bin:/bin"
    if ray is not None:
        (bin_dir / "ray").write_text(ray)
        (bin_dir / "ray").chmod(0o755)
    else:  # the real one
        path = f"{bin_dir}:{Path(shutil.which('ray')).parent}:/usr/bin:/bin"
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    if home_ray_mode is not None:
        (home / ".ray").mkdir(exist_ok=True)
        (home / ".ray").chmod(home_ray_mode)
    env = {"PATH": path, "HOME": str(home), "RAY_MESH_NODE_IP": "100.64.0.1",
           "RAY_MESH_ENV_FILE": "none", "RAY_BLOCK": "0"}
    return subprocess.run(["bash", "-c", f"umask 022; {script} \"$@\"", "x", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_head_script_creates_a_private_token(tmp_path):
    p = _run(tmp_path, str(DEPLOY / "ray-head.sh"))
    assert p.returncode == 0, p.stderr
    token = tmp_path / "home" / ".ray" / "auth_token"
    assert token.read_text() == "aaaabbbbccccdddd"
    assert _mode(token) == 0o600 and _mode(token.parent) == 0o700
    assert "ray start --head" in p.stdout


def test_scripts_tighten_an_existing_token(tmp_path):
    home_ray = tmp_path / "home" / ".ray"
    home_ray.mkdir(parents=True)
    home_ray.chmod(0o755)
    (home_ray / "auth_token").write_text("x" * 32)
    (home_ray / "auth_token").chmod(0o644)
    for script in ("ray-head.sh", "ray-worker.sh 100.64.0.9"):
        p = _run(tmp_path, str(DEPLOY / script.split()[0]), *script.split()[1:])
        assert p.returncode == 0, p.stderr
        assert _mode(home_ray / "auth_token") == 0o600 and _mode(home_ray) == 0o700
        (home_ray / "auth_token").chmod(0o644)
    assert "had mode 644" in p.stderr and "setting it to 600" in p.stderr


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray command is not installed")
def test_real_ray_generate_is_private(tmp_path):
    p = _run(tmp_path, f". {DEPLOY / 'common.sh'}; generate_token", ray=None)
    assert p.returncode == 0, p.stderr
    token = tmp_path / "home" / ".ray" / "auth_token"
    assert len(token.read_text().strip()) >= 32
    assert _mode(token) == 0o600 and _mode(token.parent) == 0o700


def test_units_set_a_private_umask():
    for unit in (DEPLOY / "systemd").glob("*.service"):
        lines = unit.read_text().splitlines()
        service = lines[lines.index("[Service]"):]
        assert "UMask=0077" in service, unit


@pytest.fixture
def home(tmp_path, monkeypatch):
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    old = os.umask(0o022)
    yield tmp_path
    os.umask(old)


def test_python_creates_a_private_token(home):
    path = auth.secure_token_file(create=True)
    assert path == home / ".ray" / "auth_token"
    assert len(path.read_text()) == 64
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    first = path.read_text()
    assert auth.secure_token_file(create=True) == path and path.read_text() == first


def test_python_tightens_an_existing_token(home, caplog):
    (home / ".ray").mkdir(mode=0o755)
    (home / ".ray" / "auth_token").write_text("t" * 64)
    (home / ".ray" / "auth_token").chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="ray_mesh.raytrain.auth"):
        auth.secure_token_file(create=False)
    assert _mode(home / ".ray" / "auth_token") == 0o600 and _mode(home / ".ray") == 0o700
    assert "had mode 644" in caplog.text and (home / ".ray" / "auth_token").read_text() == "t" * 64


def test_python_respects_explicit_settings(home, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert auth.secure_token_file(create=True) is None
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "s" * 64)
    assert auth.secure_token_file(create=True) is None
    assert not (home / ".ray").exists()
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    custom = home / "secrets" / "ray_token"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(custom))
    assert auth.secure_token_file(create=True) == custom
    assert _mode(custom) == 0o600 and _mode(custom.parent) == 0o700
