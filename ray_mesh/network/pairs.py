"""Which node pairs the pre-flight connects: every pair on a few nodes, a bounded set past that.

Up to :data:`FULL_MESH_NODES` nodes the pre-flight opens a TCP connection for every ordered
pair, n(n-1) of them (240 at 16 nodes). Past that, n(n-1) grows as n²: 16,256 connections at
128 nodes, 261,632 at 512, each node making and answering n-1 of them at once, while a
listener holds :data:`ray_mesh.network.gate.MAX_PENDING` unauthenticated connections. So
past :data:`FULL_MESH_NODES` each node checks a bounded set (:func:`check_pairs`), about
``n * (log2(n) + 3)`` connections in all, chosen so that these stay true at every size:

1. **The head, both ways.** Node 0 (rank 0's node) connects to every node, and every node
   to rank 0's rendezvous port (``ray_mesh.network.probe``; the TCPStore path every rank
   takes): a node the head cannot reach, or that cannot reach the head, is named.
2. **Every cut, both ways.** The ring in node order, each node to the next and to the one
   before: for any split of the nodes into two non-empty sets, some checked pair goes from
   each set to the other. So a partition (the nodes of one site cannot reach those of
   another at all) fails a check whichever way it runs. The ring in node order is also the
   inter-node hop of the world group's ring (ranks are node-major) and NCCL's bootstrap.
3. **Every node from several sides.** Each node connects to ``ceil(log2 n)`` partners at
   distances 1, 2, 4, ... along a cycle of the nodes in a per-run random order, and is
   connected to by as many: a node whose outbound or inbound traffic is blocked (a firewall
   on it, the wrong interface) fails all of them, and :func:`isolated` names it. Any two
   nodes are joined by at most ``ceil(log2 n)`` checked hops, and another run checks other
   partners.
4. **The layout's neighbours.** With the mesh plan, the pairs of nodes next to each other in
   a mesh dim's group (:func:`layout_pairs`: pp's send/recv stages, ``dp_replicate``'s ring
   across nodes) are checked in both directions.

What is given up past :data:`FULL_MESH_NODES`: a failure confined to one pair of nodes that
is none of the above (a rule blocking exactly node 17 -> node 301) is not seen. A run whose
collectives use that pair (gloo connects every pair of a group at creation; NCCL's trees
and all-to-all may) then waits for its process-group timeout instead of failing in seconds.
Each run checks a different ``log2 n`` partners per node, so a retry may find it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence

FULL_MESH_NODES = 16
"""Up to this many nodes the pre-flight checks every ordered pair (n(n-1) connections)."""

Pair = tuple[int, int]


def all_pairs(n: int) -> list[Pair]:
    """Every ordered pair ``(i, j)``, ``i != j``, of ``n`` nodes."""
    return [(i, j) for i in range(n) for j in range(n) if i != j]


def finger_count(n: int) -> int:
    """Partners per node at distances 1, 2, 4, ...: ``ceil(log2 n)`` (0 for one node)."""
    return math.ceil(math.log2(n)) if n > 1 else 0


def check_pairs(n: int, *, seed: int | None = None, layout: Iterable[Pair] = (),
                full_mesh_nodes: int = FULL_MESH_NODES) -> list[Pair]:
    """The ordered pairs ``(i, j)`` (node i connects to node j's listener) of ``n`` nodes,
    sorted: :func:`all_pairs` up to ``full_mesh_nodes``, else the head's star, the ring both
    ways, ``ceil(log2 n)`` partners per node in the order ``seed`` shuffles (None: node
    order) and the ``layout`` pairs in both directions (see the module's guarantees)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"check_pairs needs a node count >= 0, got {n!r}")
    if n <= max(full_mesh_nodes, 1):
        return all_pairs(n)
    out: set[Pair] = {(0, j) for j in range(1, n)}
    for i in range(n):
        out.add((i, (i + 1) % n))
        out.add((i, (i - 1) % n))
    order = list(range(n))
    if seed is not None:
        random.Random(seed).shuffle(order)
    for pos, i in enumerate(order):
        for k in range(finger_count(n)):
            out.add((i, order[(pos + 2 ** k) % n]))
    for a, b in layout:
        if a != b and 0 <= a < n and 0 <= b < n:
            out.update({(a, b), (b, a)})
    return sorted(out)


def layout_pairs(node_of_rank: Sequence[int], coords: Sequence[Mapping[str, int]],
                 dims: Collection[str]) -> set[Pair]:
    """Node pairs ``(a, b)``, ``a < b``, next to each other in a group of one of ``dims``.

    ``node_of_rank[r]`` is rank r's node, ``coords[r]`` its mesh coordinate. A dim's groups
    are the ranks that agree on every other dim; in each, ranks in coordinate order are
    neighbours (the last and the first too: a ring), and a pair of neighbours on two
    different nodes is a pair of nodes that talk. Linear in ranks x dims."""
    out: set[Pair] = set()
    for dim in dims:
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for rank, coord in enumerate(coords):
            key = tuple(sorted((d, v) for d, v in coord.items() if d != dim))
            groups.setdefault(key, []).append((coord.get(dim, 0), rank))
        for members in groups.values():
            if len(members) < 2:
                continue
            ring = [rank for _, rank in sorted(members)]
            for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
                na, nb = node_of_rank[a], node_of_rank[b]
                if na != nb:
                    out.add((min(na, nb), max(na, nb)))
    return out


def isolated(n: int, results: Mapping[Pair, bool], min_checks: int = 2
             ) -> tuple[list[int], list[int]]:
    """(nodes all of whose outbound checks failed, nodes all of whose inbound checks failed),
    among nodes with at least ``min_checks`` of that kind. ``results[(i, j)]``: whether node
    i reached node j."""
    out_checks: dict[int, list[bool]] = {}
    in_checks: dict[int, list[bool]] = {}
    for (i, j), ok in results.items():
        out_checks.setdefault(i, []).append(ok)
        in_checks.setdefault(j, []).append(ok)

    def dead(checks: dict[int, list[bool]]) -> list[int]:
        return [i for i in range(n) if len(checks.get(i, [])) >= min_checks
                and not any(checks[i])]

    return dead(out_checks), dead(in_checks)
