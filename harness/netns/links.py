"""What a test does to the links of a running :class:`~harness.netns.cluster.NetnsCluster`:
cut and restore, shape (``tc``: ``tbf``, plus ``htb`` + ``u32`` to pick one path), lower a
path's MTU, read counters. ``netem``, ``fq``, ``sfq`` and ``cake`` do not exist on this
kernel: no delay or loss can be added."""

from __future__ import annotations

import json
import sys

from harness.netns.namespaces import TAILNET_IFACE, Node, run, tbf_args
from harness.netns.ray_nodes import REACH_SCRIPT


class LinkControls:
    """Mixed into NetnsCluster (``nodes`` and ``link_iface`` come from it)."""

    nodes: list[Node]
    link_iface: str

    def cut_link(self, index: int) -> None:
        """Take node ``index`` off the bridge: its interfaces stay up but reach no one."""
        run(["ip", "link", "set", self.nodes[index].host_veth, "down"])

    def restore_link(self, index: int, timeout_s: float = 15.0) -> None:
        """Put node ``index`` back on the bridge and wait until it reaches every other node.

        Neighbour entries that failed while the link was cut would answer "no route to
        host" for a while (IPv6 most visibly), so every node forgets them, and the return
        waits (bounded) until node ``index`` gets an answer from every peer address.
        """
        run(["ip", "link", "set", self.nodes[index].host_veth, "up"])
        for node in self.nodes:
            for family in ("-4", "-6"):
                run([*node.exec_prefix(), "ip", family, "neigh", "flush", "dev",
                     self.link_iface], check=False)
        peers = [a for n in self.nodes if n.index != index for a in (n.ip, n.ip6) if a]
        run([*self.nodes[index].exec_prefix(), sys.executable, "-c", REACH_SCRIPT,
             str(timeout_s), *peers], timeout=timeout_s + 15)

    def _ends(self, index: int) -> list[tuple[list[str], str]]:
        node = self.nodes[index]
        return [([], node.host_veth), (node.exec_prefix(), self.link_iface)]

    def shape_link(self, index: int, mbit: float) -> None:
        """Cap node ``index``'s link at ``mbit`` Mbit/s in both directions: a ``tbf`` on
        each end of its bridge veth (the underlay in WireGuard mode)."""
        for prefix, dev in self._ends(index):
            run([*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(mbit)])

    def unshape_link(self, index: int) -> None:
        """Remove node ``index``'s rate cap or pair shaping (both ends)."""
        for prefix, dev in self._ends(index):
            run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], check=False)

    def shape_pair(self, a: int, b: int, mbit: float) -> None:
        """Cap only the path between nodes ``a`` and ``b`` at ``mbit`` (each direction), as
        a relayed (DERP) path among direct ones: on each side's underlay, an ``htb`` root
        sends the packets to the other's underlay address through a ``tbf``; the rest
        passes unshaped. Replaces :meth:`shape_link` on those two nodes."""
        for src, dst in ((a, b), (b, a)):
            prefix, dev = self._ends(src)[1]
            far = self.nodes[dst].lan_ip or self.nodes[dst].ip
            tc = [*prefix, "tc"]
            run([*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
                 "default", "10", "r2q", "100000"])
            run([*tc, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:10",
                 "htb", "rate", "100gbit"])
            run([*tc, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:20",
                 "htb", "rate", "100gbit"])
            run([*tc, "qdisc", "replace", "dev", dev, "parent", "1:20", "handle", "20:",
                 *tbf_args(mbit)])
            run([*tc, "filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip",
                 "prio", "1", "u32", "match", "ip", "dst", f"{far}/32", "flowid", "1:20"])

    def set_link_mtu(self, index: int, mtu: int) -> None:
        """Frames over ``mtu`` bytes to and from node ``index`` are dropped without a word
        (the MTU of its veth's bridge end; no ICMP), as on a path through a hop with a
        smaller MTU. Over WireGuard (~60 bytes of overhead, padded to 16), 1300 here leaves
        1232 bytes for the tunnel's packets: under its MTU of 1280, an MTU blackhole."""
        run(["ip", "link", "set", self.nodes[index].host_veth, "mtu", str(int(mtu))])

    def interface_counters(self, index: int, iface: str = TAILNET_IFACE) -> dict[str, int]:
        """Byte/packet counters of ``iface`` in node ``index`` (e.g. bytes across nodes)."""
        proc = run([*self.nodes[index].exec_prefix(), "ip", "-s", "-j", "link", "show",
                    "dev", iface])
        stats = json.loads(proc.stdout)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}


__all__ = ["LinkControls"]
