"""deploy/ hardening (issue "Security, round 2", items 2 and 5): the env file loader takes
only the keys it documents, firewall.sh checks its port and peer lists before touching
anything and writes atomic restore files, the systemd units are sandboxed, and the Tailscale
ACL example parses and admits only the cluster's own nodes.

Applying the firewall in a network namespace (peers admitted, others dropped, atomic
re-apply) is tests/netns/test_firewall_peers.py.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
TAILSCALE = DEPLOY / "tailscale"
NO_PEERS_FILE = {"RAY_MESH_FW_PEERS_FILE": "/nonexistent/ray-mesh-peers"}


def _head(tmp_path: Path, env_file: Path) -> subprocess.CompletedProcess:
    """ray-head.sh with a stand-in `ray` (prints what it would run and a few variables)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ray").write_text('#!/usr/bin/env bash\necho "ray $*"\n'
                                 'echo "PRELOAD=${LD_PRELOAD:-} PLUGIN=${NCCL_NET_PLUGIN:-} '
                                 'DEBUG=${NCCL_DEBUG:-} PP=${PYTHONPATH:-}"\n')
    (bin_dir / "ray").chmod(0o755)
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True, exist_ok=True)
    (home / ".ray" / "auth_token").write_text("x" * 32)
    (home / ".ray" / "auth_token").chmod(0o600)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "RAY_BLOCK": "0",
           "RAY_MESH_NODE_IP": "100.64.0.1", "RAY_MESH_ENV_FILE": str(env_file)}
    return subprocess.run([str(TAILSCALE / "ray-head.sh")], capture_output=True, text=True,
                          env=env, timeout=30)


@pytest.mark.parametrize("line", [
    "LD_PRELOAD=/tmp/evil.so", "LD_LIBRARY_PATH=/tmp", "PYTHONPATH=/tmp/evil",
    "PATH=/tmp/evil:/usr/bin", "BASH_ENV=/tmp/evil.sh", "RAY_AUTH_MODE=disabled",
    "NCCL_NET_PLUGIN=/tmp/evil.so", "NCCL_TUNER_PLUGIN=evil", "NCCL_CONF_FILE=/tmp/nccl.conf",
])
def test_env_file_refuses_keys_it_does_not_document(tmp_path, line):
    env_file = tmp_path / "nccl.env"
    env_file.write_text(f"NCCL_DEBUG=INFO\n{line}\n")
    env_file.chmod(0o644)
    p = _head(tmp_path, env_file)
    key = line.split("=", 1)[0]
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"line 2: {key} may not be set from this file" in p.stderr, p.stderr
    assert "ray start" not in p.stdout  # Ray never started with it


def test_env_file_documented_keys_load(tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text("# comment\n\nNCCL_DEBUG=WARN\nGLOO_SOCKET_IFNAME=tailscale0\n"
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1\nOMP_NUM_THREADS=4\n")
    env_file.chmod(0o644)
    p = _head(tmp_path, env_file)
    assert p.returncode == 0, p.stderr
    assert "DEBUG=WARN" in p.stdout and "PRELOAD= PLUGIN=" in p.stdout
    # Every key the shipped nccl.env sets is one the loader takes.
    p = _head(tmp_path, TAILSCALE / "nccl.env")
    assert p.returncode == 0, p.stderr


def test_env_file_writable_by_others_is_refused(tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text("NCCL_DEBUG=INFO\n")
    env_file.chmod(0o664)
    p = _head(tmp_path, env_file)
    assert p.returncode == 2 and "has mode 664: others can write it" in p.stderr, p.stderr
    env_file.chmod(0o646)
    p = _head(tmp_path, env_file)
    assert p.returncode == 2 and "chmod 644" in p.stderr, p.stderr
    env_file.write_text("NCCL_DEBUG INFO\n")  # no '='
    env_file.chmod(0o644)
    p = _head(tmp_path, env_file)
    assert p.returncode == 2 and "line 1: not a KEY=value line" in p.stderr, p.stderr


# ----------------------------------------------------------------------------- firewall.sh
def _firewall(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """firewall.sh with stand-in nft/iptables that record calls (none may happen here)."""
    bin_dir = tmp_path / "fwbin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("nft", "iptables", "ip6tables", "iptables-restore", "ip6tables-restore"):
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> '
                                    f'{tmp_path}/calls\ncat >/dev/null\n')
        (bin_dir / name).chmod(0o755)
    return subprocess.run(["bash", str(TAILSCALE / "firewall.sh"), *args], capture_output=True,
                          text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **NO_PEERS_FILE,
                               **(env or {})})


@pytest.mark.parametrize(("key", "value", "says"), [
    ("RAY_MESH_FW_PORTS", "0-100", "not a range LOW-HIGH of ports 1-65535"),
    ("RAY_MESH_FW_PORTS", "08-100", "not a range LOW-HIGH"),  # octal to some tools
    ("RAY_MESH_FW_PORTS", "1024-70000", "not a range LOW-HIGH"),
    ("RAY_MESH_FW_PORTS", "5000-1024", "LOW must not be above HIGH"),
    ("RAY_MESH_FW_PORTS", "1024", "not a range LOW-HIGH"),
    ("RAY_MESH_FW_OPEN", "8888 99999", "'99999' is not a port number"),
    ("RAY_MESH_FW_OPEN", "8888;reboot", "is not a port number"),
    ("RAY_MESH_FW_OPEN", "*", "'*' is not a port number"),
    pytest.param("RAY_MESH_FW_OPEN", " ".join(str(p) for p in range(2000, 2070)),
                 "more than 64 ports", id="RAY_MESH_FW_OPEN-70-ports"),
    ("RAY_MESH_FW_PEERS", "100.64.0.300", "'100.64.0.300' is not an IPv4 or IPv6 address"),
    ("RAY_MESH_FW_PEERS", "100.64.0.2/33", "is not an IPv4 or IPv6 address or CIDR"),
    ("RAY_MESH_FW_PEERS", "100.64.0.2 $(reboot)", "is not an IPv4 or IPv6 address"),
    ("RAY_MESH_FW_PEERS", "fd7a:::1", "is not an IPv4 or IPv6 address"),
    ("RAY_MESH_FW_V4", "100.64.0.0/99", "RAY_MESH_FW_V4='100.64.0.0/99' is not an IPv4 CIDR"),
])
@pytest.mark.parametrize("action", ["print", "apply"])
def test_bad_lists_are_refused_before_anything_runs(tmp_path, key, value, says, action):
    p = _firewall(tmp_path, action, env={key: value})
    assert p.returncode == 2, p.stdout + p.stderr
    assert says in p.stderr, p.stderr
    assert not (tmp_path / "calls").exists()  # neither nft nor iptables was touched


def test_peers_replace_the_tailnet_ranges(tmp_path):
    peers = tmp_path / "peers"
    peers.write_text("# the cluster\n100.64.0.2\n100.64.0.3  # worker 2\nfd7a:115c:a1e0::9\n")
    p = _firewall(tmp_path, env={"RAY_MESH_FW_PEERS_FILE": str(peers)})
    assert p.returncode == 0, p.stderr
    assert 'iifname "tailscale0" ip saddr { 100.64.0.2, 100.64.0.3 } accept' in p.stdout
    assert 'iifname "tailscale0" ip6 saddr { fd7a:115c:a1e0::9 } accept' in p.stdout
    assert "100.64.0.0/10" not in p.stdout and "warning" not in p.stderr
    # Without a list: the whole tailnet, and a warning that says how to narrow it.
    p = _firewall(tmp_path)
    assert 'ip saddr { 100.64.0.0/10 } accept' in p.stdout
    assert "any member of the tailnet may connect" in p.stderr
    assert "firewall.sh peers" in p.stderr
    # An empty list would shut every node out: refused.
    peers.write_text("# nobody yet\n")
    p = _firewall(tmp_path, env={"RAY_MESH_FW_PEERS_FILE": str(peers)})
    assert p.returncode == 2 and "lists no peer" in p.stderr, p.stderr


def test_iptables_rules_are_one_restore_commit_per_family(tmp_path):
    open_ports = " ".join(str(p) for p in range(8000, 8020)) + " 8000"
    p = _firewall(tmp_path, env={"RAY_MESH_FW_BACKEND": "iptables", "RAY_MESH_FW_OPEN":
                                 open_ports, "RAY_MESH_FW_PEERS": "100.64.0.2,fd7a:115c:a1e0::2"})
    assert p.returncode == 0, p.stderr
    v4, v6 = p.stdout.split("# ip6tables-restore --noflush")
    for part, peer in ((v4, "100.64.0.2"), (v6, "fd7a:115c:a1e0::2")):
        lines = [ln for ln in part.splitlines() if ln and not ln.startswith("#")]
        assert lines[0] == "*filter" and lines[1] == ":RAY_MESH - [0:0]"
        assert lines[-1] == "COMMIT" and lines[-2] == "-I INPUT 1 -j RAY_MESH"
        assert f"-A RAY_MESH -i tailscale0 -s {peer} -j RETURN" in lines
        multi = [ln.split("--dports ")[1].split()[0].split(",") for ln in lines
                 if "multiport" in ln]
        assert [len(m) for m in multi] == [15, 5]  # multiport's 15-port limit; 8000 once
        assert "-A RAY_MESH -p tcp --syn --dport 1024:65535 -j REJECT --reject-with " \
               "tcp-reset" in lines
    assert not (tmp_path / "calls").exists()


# ----------------------------------------------------------------------------- systemd units
HARDENING = ["NoNewPrivileges=yes", "ProtectSystem=full", "PrivateTmp=yes",
             "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "RestrictSUIDSGID=yes",
             "UMask=0077", "User=ray", "StateDirectory=ray-mesh",
             "Environment=RAY_TMPDIR=/var/lib/ray-mesh"]


@pytest.mark.parametrize("unit", ["ray-mesh-head.service", "ray-mesh-worker.service"])
def test_systemd_units_are_hardened(unit, tmp_path):
    text = (TAILSCALE / "systemd" / unit).read_text()
    lines = {ln.strip() for ln in text.splitlines()}
    missing = [d for d in HARDENING if d not in lines]
    assert not missing, f"{unit} lacks {missing}"
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    copy = tmp_path / unit
    copy.write_text(text)
    out = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                         text=True, timeout=60)
    # Missing /opt/ray-mesh and user ray are expected here; a directive systemd does not
    # know or cannot parse is not.
    bad = [ln for ln in (out.stdout + out.stderr).splitlines()
           if re.search(r"Unknown (key|section)|Failed to parse|Invalid|[Ii]gnoring", ln)]
    assert not bad, bad


ROOT_PATH = "PATH=/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.mark.parametrize("unit", ["ray-mesh-head.service", "ray-mesh-worker.service"])
def test_the_root_firewall_step_runs_nothing_from_the_units_path(unit, tmp_path):
    """The firewall step runs as root ("+") with the unit's environment, whose PATH puts
    the venv first: a ``bash`` or ``nft`` planted there by whoever can write the venv must
    not run. The unit's own command line runs here with such a PATH (``print`` instead of
    ``apply``: it checks the same inputs and loads nothing)."""
    line = next(ln for ln in (TAILSCALE / "systemd" / unit).read_text().splitlines()
                if "firewall.sh apply" in ln and "ExecStartPre=" in ln)
    argv = shlex.split(line.split("ExecStartPre=", 1)[1].lstrip("+-!@:"))
    assert ROOT_PATH in argv and "/bin/bash" in argv, argv
    argv = [str(TAILSCALE / "firewall.sh") if a.endswith("/deploy/tailscale/firewall.sh")
            else "print" if a == "apply" else a for a in argv]
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    for name in ("bash", "env", "nft", "iptables", "ip6tables", "tailscale", "python3"):
        (venv / name).write_text(f"#!/bin/sh\necho {name} >> {tmp_path}/ran\n"
                                 f"exec /usr/bin/{name} \"$@\"\n")
        (venv / name).chmod(0o755)
    (tmp_path / "evil.sh").write_text(f"echo BASH_ENV >> {tmp_path}/ran\n")
    env = {"PATH": f"{venv}:/usr/bin:/bin", "BASH_ENV": str(tmp_path / "evil.sh"),
           "RAY_MESH_FW_PEERS": "100.64.0.2", **NO_PEERS_FILE}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
    assert "# ray-mesh firewall" in proc.stderr, proc.stderr  # the script itself ran
    ran = (tmp_path / "ran").read_text() if (tmp_path / "ran").exists() else ""
    assert not ran, f"ran from the unit's PATH or BASH_ENV as root: {ran.split()}"


# ----------------------------------------------------------------------------- Tailscale ACL
def _hujson(text: str) -> dict:
    """HuJSON (JSON with comments and trailing commas) to a dict, for the checks below."""
    text = re.sub(r"(?m)^\s*//.*$", "", text)
    text = re.sub(r'("(?:[^"\\]|\\.)*")|\s//[^\n]*', lambda m: m.group(1) or "", text)
    text = re.sub(r",(\s*[}\]])", r"\1", text)
    return json.loads(text)


def test_acl_example_admits_only_the_cluster():
    policy = _hujson((TAILSCALE / "acl.example.hujson").read_text())
    tag = "tag:ray-mesh"
    assert tag in policy["tagOwners"]
    rules = policy["acls"]
    # Nothing admits every source or every destination (Tailscale's allow-all default).
    for rule in rules:
        assert rule["action"] == "accept"
        assert "*" not in rule["src"] and not any(d.startswith("*:") for d in rule["dst"])
    into_cluster = [r for r in rules if any(d.startswith(tag + ":") for d in r["dst"])]
    wide = [r for r in into_cluster if any(d == f"{tag}:*" for d in r["dst"])]
    assert wide and all(r["src"] == [tag] for r in wide), wide  # all ports: nodes only
    for rule in into_cluster:
        if rule not in wide:  # people: ssh and the dashboard, never Ray's random ports
            ports = {p for d in rule["dst"] for p in d.rsplit(":", 1)[1].split(",")}
            assert ports <= {"22", "8265"}, rule
    tests = policy["tests"]
    assert any(t["src"] == tag and f"{tag}:6379" in t.get("accept", []) for t in tests)
    assert any(f"{tag}:6379" in t.get("deny", []) for t in tests if t["src"] != tag)
    assert "acl.example.hujson" in (DEPLOY / "README.md").read_text()
