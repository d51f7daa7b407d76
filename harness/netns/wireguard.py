"""Real WireGuard for the virtual tailnet: ``wireguard-go`` (userspace; this kernel has no
``wireguard`` module) makes ``tailscale0`` a tun device in each node, ``wg`` configures it.

Per node: a key pair made per run (``wg genkey``/``wg pubkey``), listen port
:data:`WG_PORT` on the node's underlay (``lan0``) address, one peer entry per other node
(endpoint = that node's underlay address, allowed IPs = its tailnet /32 and /128), MTU 1280
(Tailscale's). Every wait is bounded: a missing tool or a handshake that does not happen
raises a :class:`WireGuardError` saying what to install or look at.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.netns.namespaces import TAILNET_IFACE, UNDERLAY_IFACE, Node, run

WG_PORT = 41641  # tailscaled's default UDP port
TUNNEL_MTU = 1280
DEVICE_START_S = 15.0
HANDSHAKE_S = 20.0
# One datagram into the tunnel: WireGuard starts a handshake to send it (no ping here).
_NUDGE = "import socket, sys; socket.socket(2, 2).sendto(b'x', (sys.argv[1], 9))"


class WireGuardError(RuntimeError):
    """The WireGuard tailnet could not be built (the message says what to fix)."""


def wireguard_unavailable_reason() -> str | None:
    """Why the WireGuard mode cannot run here (None when it can)."""
    missing = [t for t in ("wireguard-go", "wg") if shutil.which(t) is None]
    if missing:
        return (f"{', '.join(missing)} not installed: apt-get install -y wireguard-go "
                "wireguard-tools (or NetnsCluster(tunnel='veth') for the plain-veth mode)")
    if not Path("/dev/net/tun").exists():
        return ("/dev/net/tun is missing: wireguard-go needs the tun device (modprobe tun; "
                "in a container: --device /dev/net/tun)")
    return None


@dataclass(frozen=True)
class Keys:
    private_file: Path
    public: str


def make_keys(folder: Path, name: str) -> Keys:
    """A fresh key pair; the private key in a 0600 file that ``wg set`` reads."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    private = run(["wg", "genkey"], timeout=10).stdout.strip()
    path = folder / f"{name}.key"
    path.touch(mode=0o600)
    path.write_text(private + "\n")
    public = run(["wg", "pubkey"], input=private, timeout=10).stdout.strip()
    return Keys(path, public)


def _launch(node: Node) -> str:
    """Start ``wireguard-go`` in ``node`` until ``tailscale0`` answers ``wg show``; "" on
    success, else why it failed (its stderr without the userspace-warning banner)."""
    ns = node.exec_prefix()
    proc = subprocess.Popen([*ns, "wireguard-go", "-f", TAILNET_IFACE],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={"LOG_LEVEL": "error", "PATH":
                                                         "/usr/sbin:/usr/bin:/sbin:/bin"})
    node.infra_pids.add(proc.pid)
    deadline = time.monotonic() + DEVICE_START_S
    while run([*ns, "wg", "show", TAILNET_IFACE], check=False).returncode != 0:
        if proc.poll() is not None:
            err = [ln for ln in proc.stderr.read().splitlines()
                   if ln.strip() and ln.strip()[0] not in "┌│└"]
            return f"wireguard-go exited (rc {proc.returncode}): {' / '.join(err)[-1500:]}"
        if time.monotonic() > deadline:
            proc.kill()
            return f"wireguard-go did not create {TAILNET_IFACE} within {DEVICE_START_S:g} s"
        time.sleep(0.1)
    return ""


def start_device(node: Node, keys: Keys, prefix_len: int = 24) -> None:
    """Start ``wireguard-go`` in ``node`` and give ``tailscale0`` its key and addresses.

    One more try after a failed start: wireguard-go once exited at once (rc 1) while
    another cluster started on the same machine, and did not again in 10 starts; the
    cause is not known, so a second failure raises with its stderr."""
    why = _launch(node)
    if why:
        why = _launch(node)
    if why:
        raise WireGuardError(f"node {node.index}: {why}")
    ns = node.exec_prefix()
    run([*ns, "wg", "set", TAILNET_IFACE, "private-key", str(keys.private_file),
         "listen-port", str(WG_PORT)])
    run([*ns, "ip", "addr", "add", f"{node.ip}/{prefix_len}", "dev", TAILNET_IFACE])
    if node.ip6:
        run([*ns, "ip", "-6", "addr", "add", f"{node.ip6}/64", "dev", TAILNET_IFACE, "nodad"])
    run([*ns, "ip", "link", "set", TAILNET_IFACE, "mtu", str(TUNNEL_MTU), "up"])


def add_peer(node: Node, peer: Node, public: str) -> None:
    """Make ``peer`` (with public key ``public``) a peer of ``node``."""
    allowed = f"{peer.ip}/32" + (f",{peer.ip6}/128" if peer.ip6 else "")
    run([*node.exec_prefix(), "wg", "set", TAILNET_IFACE, "peer", public, "endpoint",
         f"{peer.lan_ip}:{WG_PORT}", "allowed-ips", allowed, "persistent-keepalive", "25"])


def handshakes(node: Node) -> dict[str, int]:
    """Public key -> latest handshake (Unix seconds; 0: never) of ``node``'s peers."""
    out = run([*node.exec_prefix(), "wg", "show", TAILNET_IFACE, "latest-handshakes"]).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines() if line.strip())}


def wait_for_handshakes(nodes: list[Node], publics: dict[int, str],
                        timeout_s: float = HANDSHAKE_S) -> None:
    """Until every node has a handshake with every other one (bounded).

    Keepalives start a handshake per peer at once; a ping nudges any that lag."""
    deadline = time.monotonic() + timeout_s
    missing: list[tuple[int, int]] = []
    while time.monotonic() < deadline:
        missing = []
        for node in nodes:
            seen = handshakes(node)
            missing += [(node.index, peer.index) for peer in nodes
                        if peer is not node and not seen.get(publics[peer.index])]
        if not missing:
            return
        for a, b in missing[:8]:
            run([*nodes[a].exec_prefix(), sys.executable, "-c", _NUDGE, nodes[b].ip],
                check=False, timeout=10)
        time.sleep(0.2)
    a, b = missing[0]
    show = run([*nodes[a].exec_prefix(), "wg", "show", TAILNET_IFACE], check=False).stdout
    raise WireGuardError(
        f"no WireGuard handshake within {timeout_s:g} s between nodes {missing[:6]} "
        f"(node {a} -> {nodes[b].lan_ip}:{WG_PORT} over {UNDERLAY_IFACE}); check that the "
        f"underlay link is up and that wireguard-go runs in both nodes. `wg show` in node "
        f"{a}:\n{show}")


__all__ = ["HANDSHAKE_S", "TUNNEL_MTU", "WG_PORT", "Keys", "WireGuardError", "add_peer",
           "handshakes", "make_keys", "start_device", "wait_for_handshakes",
           "wireguard_unavailable_reason"]
