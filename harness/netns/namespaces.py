"""One virtual machine's worth of isolation: a network namespace plus a private mount
namespace, held open by a small holder process, and the commands every layer needs.

Why a holder process: ``ip netns exec`` gives each command a fresh mount namespace, so a
tmpfs mounted by one command is gone for the next. The holder (``unshare --mount``
inside ``ip netns exec``) mounts the node's private directories once and sleeps; every
command of the node then enters *its* network and mount namespaces (``nsenter -t PID -n
-m``), so Ray, drivers, ``wireguard-go`` and ``wg`` of one node all see the same private
files, and no other node sees them. What is private (:data:`PRIVATE_DIRS`):

* ``/tmp/ray-mesh-node``: the node's own disk (Ray's ``--temp-dir``, ``TMPDIR``, and the
  place tests use for "a path only this node has");
* ``~/ray_results``: Ray Train's default storage path, local to each machine in real life;
* ``/dev/shm``: shared memory (Ray's object store, torch), per machine in real life;
* ``/var/run/wireguard``: two ``wireguard-go`` processes would otherwise fight over
  ``tailscale0.sock``.

Everything else (the repository, the cluster's own folder under ``/tmp/rmn*``, pytest's
``tmp_path``) stays shared, as a network filesystem mounted on every machine would be.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

TAILNET_IFACE = "tailscale0"
DECOY_IFACE = "eth0"
UNDERLAY_IFACE = "lan0"  # WireGuard mode: the LAN that carries the tunnel (and reaches peers)
NODE_LOCAL = Path("/tmp/ray-mesh-node")  # the same path on every node, its own files on each
# Each node's own: its scratch (TMPDIR: also where a `ray start` without --temp-dir puts
# Ray's session, as the deploy README's walkthrough runs it), Ray Train's default storage,
# shared memory and wireguard-go's sockets.
PRIVATE_DIRS = (NODE_LOCAL, Path.home() / "ray_results", Path("/dev/shm"),
                Path("/var/run/wireguard"))
HOLDER_START_S = 15.0


def run(cmd: list[str], *, check: bool = True, timeout: float = 30,
        **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` with text output; raises with stderr when ``check`` and rc != 0."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {proc.stderr}")
    return proc


# The holder: mounts a tmpfs on each private dir, says so, and sleeps until killed.
_HOLDER = """
set -e
for d in "$@"; do mount -t tmpfs -o mode=0755 rmnode "$d"; done
mkdir -p {local}/tmp {local}/ray && chmod 1777 {local}/tmp
echo ready
exec sleep infinity
"""


@dataclass
class Node:
    """One namespace node."""

    index: int
    ns: str
    ip: str  # on tailscale0
    decoy_ip: str  # on eth0 (the decoy)
    host_veth: str  # the bridge end, in the host namespace
    decoy_host: str  # the decoy's other end, in the host namespace, on no bridge
    temp_dir: Path  # Ray's --temp-dir: inside the node's private NODE_LOCAL
    resources: dict[str, float] = field(default_factory=dict)
    ip6: str = ""  # on tailscale0 too, in fd7a:115c:a1e0::/48, when the cluster has IPv6
    lan_ip: str = ""  # WireGuard mode: the underlay address on lan0
    holder: subprocess.Popen | None = None
    infra_pids: set[int] = field(default_factory=set)  # holder, wireguard-go: not "Ray"

    def exec_prefix(self) -> list[str]:
        """The command prefix that runs a program inside this node (network + files)."""
        if self.holder is None:
            return ["ip", "netns", "exec", self.ns]
        return ["nsenter", "-t", str(self.holder.pid), "-n", "-m", "--wd=" + os.getcwd(), "--"]

    def start_holder(self) -> None:
        """Start the process that keeps the node's private mounts (bounded wait)."""
        for d in PRIVATE_DIRS:
            d.mkdir(parents=True, exist_ok=True)  # mount points, empty on the host
        script = _HOLDER.format(local=NODE_LOCAL)
        self.holder = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--propagation", "private",
             "sh", "-c", script, "holder", *map(str, PRIVATE_DIRS)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.infra_pids.add(self.holder.pid)
        deadline = time.monotonic() + HOLDER_START_S
        while time.monotonic() < deadline:
            if self.holder.poll() is not None:
                raise RuntimeError(f"node {self.index}: could not set up its private mounts "
                                   f"(rc {self.holder.returncode}): {self.holder.stderr.read()}"
                                   " -- needs root and `unshare --mount` (util-linux)")
            if os.readlink(f"/proc/{self.holder.pid}/exe").endswith("sleep"):
                return
            time.sleep(0.05)
        raise RuntimeError(f"node {self.index}: its mount holder did not start within "
                           f"{HOLDER_START_S:g} s")

    def pids(self) -> list[int]:
        """Every process in this node's network namespace."""
        proc = run(["ip", "netns", "pids", self.ns], check=False)
        return [int(p) for p in proc.stdout.split() if p.strip().isdigit()]

    def work_pids(self) -> list[int]:
        """The node's processes other than its own machinery (holder, wireguard-go)."""
        return [p for p in self.pids() if p not in self.infra_pids]

    def kill_work(self, timeout_s: float = 10.0, *, everything: bool = False) -> None:
        """SIGTERM, then SIGKILL, the node's processes (bounded); ``everything``: the
        holder and wireguard-go too (the node is being thrown away)."""
        sig = signal.SIGTERM
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids() if everything else self.work_pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(0.5)
            if time.monotonic() > deadline - timeout_s / 2:
                sig = signal.SIGKILL
            if time.monotonic() > deadline:
                return

    def reap(self) -> None:
        """Collect the holder's exit status (no zombie left behind)."""
        if self.holder is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.holder.wait(timeout=5)


def check_rate(mbit: object) -> float:
    """A link rate in Mbit/s: a finite number > 0 (``tc`` would take 0 as "no limit")."""
    try:
        rate = float(mbit)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"link rate {mbit!r} is not a number of Mbit/s (e.g. 100 or 20)") \
            from None
    if isinstance(mbit, bool) or not 0 < rate < float("inf"):
        raise ValueError(f"link rate {mbit!r} must be a finite number of Mbit/s above 0 "
                         "(e.g. 100 or 20); leave it out for an unshaped link")
    return rate


def tbf_args(mbit: float) -> list[str]:
    """``tbf`` parameters for a cap of ``mbit``: the queue bound is 400 ms; the bucket holds
    2 ms of the rate (8 KiB at least): a VPN link gives no credit after it idles, and a
    larger bucket does: with 64 KiB, a 200 kB send after 100 ms idle went at 27.7 Mbit/s
    over a 20 Mbit/s link (+38%) and 136 over 100; with this bucket at 19.8 and 98
    (sustained: 19.1, 95.7, 895 at 1 Gbit/s)."""
    mbit = check_rate(mbit)
    burst = f"{max(8, round(mbit * 1e6 / 8 * 0.002 / 1024))}kb"
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", burst, "latency", "400ms"]


def text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


__all__ = ["DECOY_IFACE", "NODE_LOCAL", "PRIVATE_DIRS", "TAILNET_IFACE", "UNDERLAY_IFACE",
           "Node", "check_rate", "run", "tbf_args", "text"]
