"""deploy/: shellcheck, the scripts' error paths, the env file, the KubeRay manifest.

The scripts' happy path (ray start over a stand-in `tailscale`) runs in tests/test_multinode.py,
which starts its whole virtual cluster through them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRIPTS = [DEPLOY / "tailscale" / n
           for n in ("ray-head.sh", "ray-worker.sh", "common.sh", "firewall.sh")]


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install -y shellcheck)")
def test_scripts_are_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True,
                          text=True, cwd=DEPLOY / "tailscale", timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _script(name: str, tmp_path: Path, fake_tailscale: str | None, *args: str,
            env: dict | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    # A `ray` that only records its arguments: these tests check the scripts, not Ray.
    (bin_dir / "ray").write_text('#!/usr/bin/env bash\necho "ray $*"\n'
                                 'echo "AUTH=$RAY_AUTH_MODE NCCL=$NCCL_SOCKET_IFNAME '
                                 'THREADS=$NCCL_SOCKET_NTHREADS"\n')
    if fake_tailscale is not None:
        (bin_dir / "tailscale").write_text(f"#!/usr/bin/env bash\n{fake_tailscale}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), **(env or {})}
    return subprocess.run([str(DEPLOY / "tailscale" / name), *args], capture_output=True,
                          text=True, env=full_env, timeout=30)


def test_head_uses_tailnet_ip_for_node_and_dashboard(tmp_path):
    (tmp_path / "home" / ".ray").mkdir(parents=True)
    (tmp_path / "home" / ".ray" / "auth_token").write_text("x" * 32)
    p = _script("ray-head.sh", tmp_path, 'echo 100.101.102.103', "--num-gpus=4",
                env={"RAY_BLOCK": "1", "NCCL_SOCKET_NTHREADS": "8"})
    assert p.returncode == 0, p.stderr
    assert "--node-ip-address=100.101.102.103" in p.stdout
    assert "--dashboard-host=100.101.102.103" in p.stdout and "0.0.0.0" not in p.stdout
    assert "--block" in p.stdout and "--num-gpus=4" in p.stdout
    # Token auth on; nccl.env loaded, but a value already in the environment wins.
    assert "AUTH=token NCCL==tailscale0 THREADS=8" in p.stdout


def test_scripts_fail_with_the_fix(tmp_path):
    p = _script("ray-head.sh", tmp_path, None)
    assert p.returncode == 2 and "'tailscale' command is not on PATH" in p.stderr
    p = _script("ray-head.sh", tmp_path, "exit 0")  # tailscale down: no address
    assert p.returncode == 2 and "tailscale up" in p.stderr
    p = _script("ray-worker.sh", tmp_path, "echo 100.64.0.2")
    assert p.returncode == 2 and "RAY_HEAD_ADDRESS" in p.stderr
    p = _script("ray-worker.sh", tmp_path, "echo 100.64.0.2", "100.64.0.1")
    assert p.returncode == 2 and "auth_token" in p.stderr  # no token on this node
    (tmp_path / "home" / ".ray" / "auth_token").write_text("x" * 32)
    p = _script("ray-worker.sh", tmp_path, "echo 100.64.0.2", "100.64.0.1",
                env={"RAY_BLOCK": "0"})
    assert p.returncode == 0, p.stderr
    assert "--address=100.64.0.1:6379 --node-ip-address=100.64.0.2" in p.stdout
    assert "--block" not in p.stdout


def test_env_file_and_manifest_parse():
    env = {}
    for line in (DEPLOY / "tailscale" / "nccl.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v
    assert env["NCCL_SOCKET_IFNAME"] == "=tailscale0" and env["GLOO_SOCKET_IFNAME"] == "tailscale0"
    from ray_mesh.network.interfaces import NCCL_VPN_DEFAULTS

    assert {k: env[k] for k in NCCL_VPN_DEFAULTS} == NCCL_VPN_DEFAULTS  # one source of truth
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "raycluster.yaml").read_text()))
    rc = docs[0]
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    group = rc["spec"]["workerGroupSpecs"][0]
    container = group["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"]
    names = {e["name"] for e in container["env"]}
    assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= names
    for unit in (DEPLOY / "tailscale" / "systemd").glob("*.service"):
        text = unit.read_text()
        assert "ExecStart=/opt/ray-mesh/deploy/tailscale/ray-" in text
        assert "After=network-online.target tailscaled.service" in text
    assert os.access(DEPLOY / "tailscale" / "ray-head.sh", os.X_OK)


def _firewall(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # Stand-in nft/iptables that only record calls: print mode must never run them.
    bin_dir = tmp_path / "fwbin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("nft", "iptables"):
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> {tmp_path}/calls\n')
        (bin_dir / name).chmod(0o755)
    return subprocess.run(["bash", str(DEPLOY / "tailscale" / "firewall.sh"), *args],
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                               "RAY_MESH_FW_PEERS_FILE": "/nonexistent", **(env or {})})


def test_firewall_print_mode_changes_nothing(tmp_path):
    p = _firewall(tmp_path, env={"RAY_MESH_FW_OPEN": "8888 9090"})
    assert p.returncode == 0, p.stderr
    assert 'iifname "tailscale0" ip saddr { 100.64.0.0/10 } accept' in p.stdout
    assert "tcp dport { 8888, 9090 } accept" in p.stdout
    assert "tcp dport 1024-65535" in p.stdout and "reject with tcp reset" in p.stdout
    p = _firewall(tmp_path, "print", env={"RAY_MESH_FW_BACKEND": "iptables",
                                          "RAY_MESH_FW_IFACE": "wg0"})
    assert p.returncode == 0, p.stderr
    v6 = p.stdout.split("# ip6tables-restore --noflush")[1]  # one restore input per family
    assert "-A RAY_MESH -i wg0 -s fd7a:115c:a1e0::/48 -j RETURN" in v6
    assert "--syn --dport 1024:65535 -j REJECT --reject-with tcp-reset" in p.stdout
    assert not (tmp_path / "calls").exists()  # printed, never run


def test_firewall_refuses_bad_settings_with_the_fix(tmp_path):
    bad = {"RAY_MESH_FW_PORTS": "abc", "RAY_MESH_FW_OPEN": "22 x", "RAY_MESH_FW_V4": "x",
           "RAY_MESH_FW_IFACE": "bad iface!", "RAY_MESH_FW_BACKEND": "pf"}
    for key, value in bad.items():
        p = _firewall(tmp_path, "print", env={key: value})
        assert p.returncode == 2 and f"{key}=" in p.stderr, (key, p.stderr)
    p = _firewall(tmp_path, "frobnicate")
    assert p.returncode == 2 and "use print (default), apply, remove, status or peers" in p.stderr
    assert not (tmp_path / "calls").exists()


@pytest.mark.parametrize("how", ["tmpdir", "temp_dir_arg"])
def test_a_restarted_worker_node_does_not_replay_dead_workers_logs(tmp_path, how):
    """ray-worker.sh, before ``ray start``: the logs of workers that are gone move to
    ``logs/old/`` (the node rejoins the head's session folder, whose log monitor would read
    them to the driver's console again); a live process's log stays where it is."""
    root = tmp_path / "ray"
    logs = root / "session_2026-11-27_10-00-00_000000_1" / "logs"
    logs.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = [logs / f"worker-ab12-01000000-{dead.pid}.{ext}" for ext in ("out", "err")]
    live = logs / f"worker-cd34-01000000-{os.getpid()}.out"
    other = logs / "raylet.out"
    for f in (*gone, live, other):
        f.write_text("printed once\n")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    arg = f"--temp-dir={root}" if how == "temp_dir_arg" else ""
    if arg:
        env["TMPDIR"] = str(tmp_path / "elsewhere")
    proc = subprocess.run(["bash", "-c", f". {DEPLOY / 'tailscale' / 'common.sh'}; "
                           f"retire_dead_worker_logs --num-cpus=1 {arg}"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert not any(f.exists() for f in gone) and live.exists() and other.exists()
    assert sorted(p.name for p in (logs / "old").iterdir()) == sorted(f.name for f in gone)
