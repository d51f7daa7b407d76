"""Which network interface and address a node's collectives use (no Ray import).

NCCL and gloo pick an interface on their own, and on a box with eth0, docker0 and
tailscale0 they often pick one the other nodes cannot reach, then hang. ray_mesh instead
uses the interface that carries the node's Ray IP (the address ``ray start
--node-ip-address`` was given, on Tailscale ``tailscale ip -4``), else one in Tailscale's
ranges, else the name the user gave.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

from ray_mesh.core.topology import WorkerReport
from ray_mesh.errors import NetworkError

logger = logging.getLogger(__name__)

TAILSCALE_NETWORKS = (
    ipaddress.ip_network("100.64.0.0/10"),
    ipaddress.ip_network("fd7a:115c:a1e0::/48"),
)

NCCL_VPN_DEFAULTS: dict[str, str] = {
    # Over a VPN there is no InfiniBand or RoCE: go straight to TCP sockets instead of
    # probing IB devices and network plugins (which can pick a non-VPN NIC or stall).
    "NCCL_IB_DISABLE": "1",
    "NCCL_NET": "Socket",
    # Several TCP streams per peer fill a high-latency WireGuard link better than one.
    # NCCL caps the product at 64.
    "NCCL_SOCKET_NTHREADS": "4",
    "NCCL_NSOCKS_PERTHREAD": "4",
}
"""NCCL settings ray_mesh adds on a VPN interface unless the user set them (see README)."""

VPN_INTERFACE_PREFIXES = ("tailscale", "wg", "tun", "zt", "nebula")
"""Interface names that are VPN tunnels (Tailscale, WireGuard, OpenVPN, ZeroTier, Nebula)."""


@dataclass(frozen=True)
class Choice:
    """The interface a node uses for collectives and the address it is reached on."""

    interface: str
    address: str
    family: str  # "AF_INET" or "AF_INET6"
    reason: str


def local_interfaces() -> dict[str, list[str]]:
    """Map interface name -> its IPv4/IPv6 addresses (link-local IPv6 left out)."""
    table: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            addr = a.address.split("%", 1)[0]
            ip = ipaddress.ip_address(addr)
            if ip.version == 6 and ip.is_link_local:
                continue
            table.setdefault(name, []).append(addr)
    return table


def in_tailscale_range(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return any(ip in net for net in TAILSCALE_NETWORKS if net.version == ip.version)


def _prefer_family(addrs: list[str], like: str) -> str:
    """The first of ``addrs`` in the same family as ``like`` (IPv4 when ``like`` is not an IP)."""
    try:
        version = ipaddress.ip_address(like).version
    except ValueError:
        version = 4
    same = [a for a in addrs if ipaddress.ip_address(a).version == version]
    return (same or addrs)[0]


def _family(address: str) -> str:
    return "AF_INET6" if ipaddress.ip_address(address).version == 6 else "AF_INET"


def _describe(interfaces: Mapping[str, list[str]]) -> str:
    return ", ".join(f"{n} ({', '.join(a) or 'no address'})" for n, a in sorted(interfaces.items()))


def choose_interface(
    node_ip: str,
    requested: str = "auto",
    interfaces: Mapping[str, list[str]] | None = None,
) -> Choice:
    """Pick this node's interface for NCCL/gloo.

    ``requested`` is ``"auto"`` or an interface name. With ``"auto"``: the interface holding
    ``node_ip``, else the first one with an address in Tailscale's ranges.
    """
    table = dict(local_interfaces() if interfaces is None else interfaces)
    if requested and requested != "auto":
        if requested not in table:
            raise NetworkError(
                f"Interface {requested!r} does not exist on this node ({node_ip}). Interfaces "
                f"here: {_describe(table)}. Pass one of them as interface=, or 'auto'."
            )
        addrs = table[requested]
        if not addrs:
            raise NetworkError(
                f"Interface {requested!r} on node {node_ip} has no IP address; bring it up "
                f"(for Tailscale: `tailscale up`) or choose another: {_describe(table)}."
            )
        address = node_ip if node_ip in addrs else _prefer_family(addrs, node_ip)
        return Choice(requested, address, _family(address), "named by the user")

    for name, addrs in table.items():
        if node_ip in addrs:
            return Choice(name, node_ip, _family(node_ip), "carries the node's Ray IP")
    # IPv4 first: NCCL and gloo have the fewest surprises with it.
    for addr, name in sorted(((a, n) for n, addrs in table.items() for a in addrs),
                             key=lambda t: ipaddress.ip_address(t[0]).version):
        if in_tailscale_range(addr):
            return Choice(name, addr, _family(addr), "address in Tailscale's range")
    raise NetworkError(
        f"No interface on node {node_ip} holds its Ray node IP {node_ip}, and none has a "
        f"Tailscale address. Interfaces here: {_describe(table)}. Start Ray on this node with "
        f"`ray start --node-ip-address=<address of the interface other nodes reach>` "
        f"(on Tailscale: $(tailscale ip -4)), or pass interface='<name>'."
    )


def choose_all(reports: Sequence[WorkerReport], requested: str) -> list[Choice]:
    """Choose every worker's interface on the driver; one error naming every failing node."""
    choices: list[Choice] = []
    failures: dict[str, str] = {}
    for r in reports:
        try:
            choices.append(choose_interface(r.node_ip, requested, r.interfaces))
        except NetworkError as exc:
            who = r.hostname or f"rank {r.rank}"
            failures.setdefault(r.node_ip, f"node {r.node_ip} ({who}): {exc}")
    if failures:
        raise NetworkError(
            f"No usable interface on {len(failures)} of "
            f"{len({r.node_ip for r in reports})} node(s): "
            + "; ".join(failures.values())
        )
    if requested in ("auto", "", None):
        check_one_network(reports, choices)
    return choices


def _tailnet_address(interfaces: Mapping[str, list[str]]) -> tuple[str, str] | None:
    """(interface, address) of this node's first IPv4 address in Tailscale's ranges."""
    for name, addrs in sorted(interfaces.items()):
        for addr in addrs:
            if in_tailscale_range(addr) and ipaddress.ip_address(addr).version == 4:
                return name, addr
    return None


def check_one_network(reports: Sequence[WorkerReport], choices: Sequence[Choice]) -> None:
    """Refuse a cluster where some nodes registered with Ray under their tailnet address and
    others under another (LAN) address although they have a tailnet one.

    Ray takes a node's IP from ``--node-ip-address``, else from the route to the head's
    address: ``ray start --address=<the head's LAN name or address>`` registers the LAN
    address, and a node across the internet cannot reach it. Collectives would then hang
    in the first cross-node call; this names the node and the fix before any process group.
    """
    on_tailnet = {r.node_ip for r, c in zip(reports, choices, strict=True)
                  if in_tailscale_range(c.address)}
    if not on_tailnet:
        return  # a LAN cluster (Tailscale installed or not): one network, nothing to refuse
    off: dict[str, str] = {}
    for r, c in zip(reports, choices, strict=True):
        tailnet = _tailnet_address(r.interfaces)
        if in_tailscale_range(c.address) or tailnet is None or r.node_ip in off:
            continue
        off[r.node_ip] = (f"node {r.node_ip} ({r.hostname or f'rank {r.rank}'}) registered "
                          f"with Ray under {r.node_ip} ({c.interface}), though it has the "
                          f"tailnet address {tailnet[1]} on {tailnet[0]}")
    if off:
        vpn = sorted({c.interface for c in choices if in_tailscale_range(c.address)})[0]
        raise NetworkError(
            f"{'; '.join(off.values())}, while {len(on_tailnet)} other node(s) registered "
            f"their tailnet address ({', '.join(sorted(on_tailnet))}): a node reached only "
            f"on the tailnet cannot reach a LAN address. Restart Ray on that node with its "
            f"tailnet address: `ray stop; ray start --address=<head tailnet ip>:6379 "
            f"--node-ip-address=$(tailscale ip -4)` (deploy/tailscale/ray-worker.sh does "
            f"both). If every node does reach every other, pass interface='{vpn}' to use "
            f"the tailnet for the collectives anyway.")


def url_host(address: str) -> str:
    """An address as it goes into a URL or host:port (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def host_port(address: str, port: int) -> str:
    """``host:port`` with IPv6 bracketed (``[fd7a:115c:a1e0::1]:29500``)."""
    return f"{url_host(address)}:{port}"


def rendezvous_url(address: str, port: int) -> str:
    """torch's ``tcp://`` init URL for rank 0's address; MASTER_ADDR itself stays bare."""
    return f"tcp://{host_port(address, port)}"


def split_host_port(text: str, default_port: int | None = None) -> tuple[str, int]:
    """Parse ``host:port``, ``[v6]:port``, a bare v6 address or host (then ``default_port``).

    Empty text and a malformed bracket (``[::1``, ``[]:6379``, ``[::1]x``, a name in
    brackets) are refused: ``ray.init`` reads an empty address as "auto" (whatever Ray runs
    on this machine), and a half-written bracket would be joined as some other host.
    """
    text = text.strip()
    if not text:
        raise ValueError("the address is empty: write host:port ([v6]:port for IPv6).")
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        try:
            ipaddress.IPv6Address(host)
            good = bool(closed) and (not rest or rest.startswith(":"))
        except ValueError:
            good = False
        if not good:
            raise ValueError(f"{text[:100]!r} is not [IPv6]:port: close the bracket around an "
                             f"IPv6 address, e.g. [fd7a:115c:a1e0::1]:6379.")
        port_text = rest[1:]
        if rest == ":":
            raise ValueError(f"{text[:100]!r} has no valid port: write [v6]:port.")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a hostname, an IPv4 address, or a bare IPv6 address
        host, port_text = text, ""
    if not port_text:
        if default_port is None:
            raise ValueError(f"{text!r} has no port: write host:port ([v6]:port for IPv6).")
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r} has no valid port: write host:port ([v6]:port for IPv6).")
    return host, int(port_text)


def is_vpn(choice: Choice) -> bool:
    """Whether the chosen interface is a VPN tunnel (Tailscale range or a tunnel name)."""
    return in_tailscale_range(choice.address) or choice.interface.startswith(
        VPN_INTERFACE_PREFIXES)


def free_port(address: str) -> int:
    """A TCP port free on ``address`` right now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def collective_env(choice: Choice, vpn_defaults: bool | str = "auto") -> dict[str, str]:
    """Environment that pins NCCL and gloo to the chosen interface and address family.

    ``vpn_defaults``: ``"auto"`` adds :data:`NCCL_VPN_DEFAULTS` when the interface is a VPN
    tunnel (on an InfiniBand cluster, disabling IB would be a disaster); True/False force it.
    """
    env = {
        # "=" asks NCCL for an exact match: plain "eth0" would also match "eth01".
        "NCCL_SOCKET_IFNAME": f"={choice.interface}",
        "GLOO_SOCKET_IFNAME": choice.interface,
        "NCCL_SOCKET_FAMILY": choice.family,
    }
    if vpn_defaults is True or (vpn_defaults == "auto" and is_vpn(choice)):
        env.update(NCCL_VPN_DEFAULTS)
    return env


IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The interface variables a user may set; :func:`apply_env` keeps theirs over ours."""


def _ifname_missing(var: str, value: str, names: Sequence[str]) -> list[str] | None:
    """The entries of ``var=value`` that match no interface in ``names`` (None: all fine).

    gloo opens a device per comma-separated name, so every one must exist; NCCL takes
    prefixes (``=name`` exact, ``^...`` an exclusion list) and needs one that matches.
    """
    if var.startswith("NCCL"):
        if value.startswith("^"):
            return None
        exact = value.startswith("=")
        wanted = [w.strip() for w in value.lstrip("=").split(",") if w.strip()]
        hits = [w for w in wanted if any(n == w if exact else n.startswith(w) for n in names)]
        return None if hits or not wanted else wanted
    missing = [w.strip() for w in value.split(",") if w.strip() and w.strip() not in names]
    return missing or None


def user_ifname_problems(env: Mapping[str, str], interfaces: Mapping[str, list[str]], *,
                         nccl: bool) -> list[str]:
    """One line per user-set interface variable in ``env`` that names no interface here.

    ray_mesh keeps a value the user set (:func:`apply_env`), so a stale
    ``GLOO_SOCKET_IFNAME=eth1`` would otherwise make gloo fail (or NCCL hang) after
    bring-up. ``nccl``: also check NCCL's variable (only read by an nccl backend).
    """
    out = []
    for var in IFNAME_VARS if nccl else IFNAME_VARS[:1]:
        value = env.get(var)
        missing = _ifname_missing(var, value, list(interfaces)) if value else None
        if missing:
            out.append(f"{var}={value} (set by the user, so ray_mesh keeps it) names no "
                       f"interface there ({', '.join(missing)} not found; interfaces: "
                       f"{', '.join(sorted(interfaces)) or 'none'}). Unset {var} to let "
                       f"ray_mesh pin collectives to the interface it chooses, or set it to "
                       f"an interface every node has.")
    return out


def check_user_ifnames(reports: Sequence[WorkerReport], envs: Sequence[Mapping[str, str]],
                       *, nccl: bool) -> None:
    """Every worker's user-set interface variables against its node's interfaces; one
    NetworkError naming each failing node."""
    failures: dict[str, str] = {}
    for r, env in zip(reports, envs, strict=True):
        problems = user_ifname_problems(env, r.interfaces, nccl=nccl)
        if problems:
            who = r.hostname or f"rank {r.rank}"
            failures.setdefault(r.node_ip, f"node {r.node_ip} ({who}): {problems[0]}")
    if failures:
        raise NetworkError("A collective interface variable set by the user does not fit "
                           + "; ".join(failures.values()))


def user_ifname_env() -> dict[str, str]:
    """This process's interface variables (run on each worker before ray_mesh sets them)."""
    return {k: os.environ[k] for k in IFNAME_VARS if k in os.environ}


def user_kept(wanted: Mapping[str, str], in_force: Mapping[str, str]) -> dict[str, str]:
    """The keys where a value the user set won over ray_mesh's (key -> the user's value)."""
    return {k: in_force[k] for k in wanted if in_force.get(k) != wanted[k]}


def rank_env_line(rank: int, node_rank: int, choice: Choice, in_force: Mapping[str, str],
                  kept: Mapping[str, str]) -> str:
    """The one line every rank logs: interface, address, and each value with its source."""
    values = " ".join(f"{k}={v}{' (set by the user)' if k in kept else ''}"
                      for k, v in sorted(in_force.items()))
    return (f"ray_mesh rank {rank} (node {node_rank}): interface {choice.interface} "
            f"[{choice.reason}], address {choice.address}, {values}")


def apply_env(wanted: Mapping[str, str], *, keep_user: bool = True) -> dict[str, str]:
    """Set ``wanted`` in ``os.environ``; a value the user already set wins and is logged.

    Returns the values in force afterwards, for the layout table and the logs.
    """
    in_force: dict[str, str] = {}
    for key, value in wanted.items():
        current = os.environ.get(key)
        if keep_user and current is not None and current != value:
            logger.info("ray_mesh: keeping %s=%s set by the user (ray_mesh would use %s)",
                        key, current, value)
            in_force[key] = current
            continue
        os.environ[key] = value
        in_force[key] = value
    return in_force
