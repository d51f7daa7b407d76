"""The virtual Tailscale cluster, split by concept:

* :mod:`.namespaces`: one node's isolation (network + private mount namespace, held by a
  holder process), the ``tc`` and availability helpers;
* :mod:`.wireguard`: a real WireGuard ``tailscale0`` per node (``wireguard-go``, ``wg``);
* :mod:`.ray_nodes`: ``ray start`` per node and the bounded waits;
* :mod:`.agent`: a Ray-free helper process inside a node;
* :mod:`.cluster`: :class:`NetnsCluster`, which puts these together.
"""

from harness.netns.agent import NamespaceAgent
from harness.netns.available import netns_unavailable_reason
from harness.netns.cluster import REPO, TUNNELS, NetnsCluster
from harness.netns.namespaces import (
    DECOY_IFACE,
    NODE_LOCAL,
    TAILNET_IFACE,
    UNDERLAY_IFACE,
    Node,
    check_rate,
)
from harness.netns.wireguard import WireGuardError, wireguard_unavailable_reason

__all__ = ["DECOY_IFACE", "NODE_LOCAL", "REPO", "TAILNET_IFACE", "TUNNELS", "UNDERLAY_IFACE",
           "NamespaceAgent", "NetnsCluster", "Node", "WireGuardError", "check_rate",
           "netns_unavailable_reason", "wireguard_unavailable_reason"]
