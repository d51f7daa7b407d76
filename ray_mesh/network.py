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
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

logger = logging.getLogger(__name__)

TAILSCALE_NETWORKS = (
    ipaddress.ip_network("100.64.0.0/10"),
    ipaddress.ip_network("fd7a:115c:a1e0::/48"),
)

NCCL_VPN_DEFAULTS: dict[str, str] = {
    # Over a VPN there is no InfiniBand or RoCE: go straight to sockets instead of probing.
    "NCCL_IB_DISABLE": "1",
}
"""NCCL settings ray_mesh adds unless the user set them (documented in the README)."""


class NetworkError(RuntimeError):
    """An interface or address problem; the message names the node, interface and fix."""


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
        address = node_ip if node_ip in addrs else addrs[0]
        return Choice(requested, address, _family(address), "named by the user")

    for name, addrs in table.items():
        if node_ip in addrs:
            return Choice(name, node_ip, _family(node_ip), "carries the node's Ray IP")
    for name, addrs in table.items():
        for addr in addrs:
            if any(ipaddress.ip_address(addr) in net for net in TAILSCALE_NETWORKS
                   if net.version == ipaddress.ip_address(addr).version):
                return Choice(name, addr, _family(addr), "address in Tailscale's range")
    raise NetworkError(
        f"No interface on node {node_ip} holds its Ray node IP {node_ip}, and none has a "
        f"Tailscale address. Interfaces here: {_describe(table)}. Start Ray on this node with "
        f"`ray start --node-ip-address=<address of the interface other nodes reach>` "
        f"(on Tailscale: $(tailscale ip -4)), or pass interface='<name>'."
    )


def url_host(address: str) -> str:
    """An address as it goes into a URL or host:port (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def free_port(address: str) -> int:
    """A TCP port free on ``address`` right now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def collective_env(choice: Choice) -> dict[str, str]:
    """Environment that pins NCCL and gloo to the chosen interface and address family."""
    env = {
        # "=" asks NCCL for an exact match: plain "eth0" would also match "eth01".
        "NCCL_SOCKET_IFNAME": f"={choice.interface}",
        "GLOO_SOCKET_IFNAME": choice.interface,
        "NCCL_SOCKET_FAMILY": choice.family,
    }
    env.update(NCCL_VPN_DEFAULTS)
    return env


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
