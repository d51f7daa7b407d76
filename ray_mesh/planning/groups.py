"""Unequal nodes: one replica group per node, each sized to its devices and paced by speed.

A mesh needs the same number of workers on every node (:mod:`.cluster` leaves the odd node
out). Replica groups do not: each node runs one group over its own devices (``dp_shard`` over
them), and with ``shares="speed"`` each group's batch is sized to its speed, so a step takes
about the time of the whole cluster's throughput, not of its slowest node. This module:

* :func:`groups_from_nodes`: the groups of a live cluster (``groups="auto"``): one per alive
  node with at least one worker's worth of the resource, pinned to it;
* :func:`plan_groups`: the expected step time and each node's share, for ``ray-mesh plan
  --per-node 2,2,1 --node-speed 1,1,0.5``, next to the two ways a uniform mesh would run the
  same cluster (leave the odd nodes out; pace everyone at the slowest).

Speeds are relative per-device throughputs (1.0: the device ``compute_s`` was measured on);
a live run measures them itself in its first segments (:mod:`ray_mesh.replicas.shares`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ray_mesh.planning.cluster import NodeInfo
from ray_mesh.planning.cost import FP32, Links, ModelStats, PlanError, Workload, _ar
from ray_mesh.replicas.layouts import GroupLayoutError, GroupSpec


def groups_from_nodes(nodes: Sequence[NodeInfo], resource: str, per_worker: float = 1.0
                      ) -> list[GroupSpec]:
    """One group per alive node: ``dp_shard`` over as many workers as the node has
    ``resource`` for (``per_worker`` each), pinned to the node's address."""
    if not per_worker > 0:
        raise GroupLayoutError(f"{resource} per worker must be above 0, got {per_worker}")
    out = [GroupSpec({"dp_shard": int(n.amount(resource) // per_worker)}, n.ip)
           for n in nodes if n.alive and n.amount(resource) >= per_worker]
    if not out:
        have = ", ".join(f"{n.label}: {n.amount(resource):g}" for n in nodes if n.alive)
        raise GroupLayoutError(f"groups='auto': no alive node has {per_worker:g} {resource} "
                               f"for a worker (nodes: {have or 'none alive'}); start workers "
                               f"with that resource or give the groups' layouts")
    return out


def check_room(specs: Sequence[GroupSpec], per_worker: dict[str, float],
               nodes: Sequence[NodeInfo]) -> None:
    """Every group fits one alive node (its own node when pinned), counting the node's whole
    resources: a group that fits nowhere would wait for resources forever (``STRICT_PACK``),
    so it is refused before any group starts, naming the group, what it needs and the nodes."""
    alive = [n for n in nodes if n.alive]
    for i, spec in enumerate(specs):
        need = {r: a * spec.workers for r, a in per_worker.items() if a > 0}
        where = [n for n in alive if spec.node is None or n.ip == spec.node]
        if spec.node is not None and not where:
            raise GroupLayoutError(
                f"replica group {i} ({spec.label}) is pinned to node {spec.node}, which is not "
                f"an alive node of this cluster (alive: "
                f"{', '.join(n.ip for n in alive) or 'none'}): fix its node: address")
        if not any(all(n.amount(r) >= a for r, a in need.items()) for n in where):
            wants = ", ".join(f"{r}: {a:g}" for r, a in need.items())
            have = "; ".join(f"{n.label}: " + ", ".join(f"{r} {n.amount(r):g}" for r in need)
                             for n in where)
            raise GroupLayoutError(
                f"replica group {i} ({spec.label}) needs {wants} on one node, and no "
                f"{'such ' if spec.node else ''}node has that ({have}): give it fewer workers, "
                f"lower resources_per_worker, or use groups='auto' (one group per node, sized "
                f"to it)")


def format_node_groups(specs: Sequence[GroupSpec],
                       rates: dict[str, float | str] | None = None) -> str:
    """The live cluster as replica groups (``groups="auto"``): one line per node with its
    layout and, given ``rates`` (each node's measured matmuls/s per device,
    ``ray-mesh plan --calibrate``, or why it was not measured), its relative speed and share
    of each step."""
    lines = ["As replica groups (fit_replica_groups(groups='auto') or replica_groups: {groups: "
             "auto}): one group per node, over its devices"]
    known = {ip: float(r) for ip, r in (rates or {}).items()
             if isinstance(r, (int, float)) and r > 0}
    top = max(known.values(), default=0.0)
    whole = sum(known.get(str(s.node), 0.0) * s.workers for s in specs)
    for i, s in enumerate(specs):
        line = f"  group {i}: node {s.node}, {s.workers} worker(s), layout {s.label}"
        rate = known.get(str(s.node))
        if rates is not None and rate:
            line += (f", speed {rate / top:.2f} per device ({rate:.3g} matmuls/s), share "
                     f"{100 * rate * s.workers / whole:.0f}% with shares='speed'")
        elif rates is not None:
            why = rates.get(str(s.node))
            line += f", speed not measured ({why if isinstance(why, str) else 'no answer'})"
        lines.append(line)
    if rates is None:
        lines.append("  (--calibrate times each node's device for ~1 s and prints the shares; "
                     "a run with shares='speed' measures them itself)")
    return "\n".join(lines)


@dataclass(frozen=True)
class NodeShare:
    """One node's group in a plan."""

    node: int
    workers: int
    speed: float        # per device, relative
    share: float        # of each step's samples
    compute_s: float    # its part of a step at that share


@dataclass(frozen=True)
class GroupsPlan:
    shares: list[NodeShare]
    step_s: float            # by speed: compute + the boundary's exchange
    compute_s: float
    exchange_s: float
    equal_step_s: float      # the same groups, equal shares (the slowest node's pace)
    leave_out_step_s: float  # a uniform mesh over the nodes of the most common size
    left_out: list[int]

    def lines(self) -> list[str]:
        out = [f"replica groups, one per node, shares by speed: expected step "
               f"{self.step_s:.3g} s (compute {self.compute_s:.3g} s + exchange "
               f"{self.exchange_s:.3g} s)"]
        for s in self.shares:
            out.append(f"  node {s.node}: {s.workers} worker(s), layout dp_shard={s.workers}, "
                       f"speed {s.speed:g} per device, share {100 * s.share:.0f}% "
                       f"({s.compute_s:.3g} s of compute per step)")
        out.append(f"  vs equal shares (everyone at the slowest node's pace): "
                   f"{self.equal_step_s:.3g} s per step ({self.equal_step_s / self.step_s:.2f}x)")
        lo = ", ".join(str(i) for i in self.left_out) or "none"
        out.append(f"  vs one uniform mesh (nodes {lo} left out): {self.leave_out_step_s:.3g} s "
                   f"per step ({self.leave_out_step_s / self.step_s:.2f}x)")
        return out


def _check(per_node: Sequence[int], speeds: Sequence[float]) -> None:
    if not per_node or any(isinstance(w, bool) or not isinstance(w, int) or w < 1
                           for w in per_node):
        raise PlanError(f"--per-node {list(per_node)}: give each node's workers, at least 1 "
                        "each (e.g. --per-node 2,2,1)")
    if len(speeds) != len(per_node):
        raise PlanError(f"--node-speed has {len(speeds)} value(s) for {len(per_node)} node(s): "
                        "give one per node, in the same order as --per-node")
    if any(not 0 < s < math.inf for s in speeds):
        raise PlanError(f"--node-speed {list(speeds)}: each speed must be above 0 (1.0: the "
                        "device compute_s was measured on)")


def plan_groups(per_node: Sequence[int], speeds: Sequence[float], stats: ModelStats,
                work: Workload, cross_mbit: float, latency_s: float = 0.0,
                every: int = 1) -> GroupsPlan:
    """Expected step time of one replica group per node with shares by speed; ``every``: the
    inner steps per boundary (DiLoCo; 1 for a gradient average every step)."""
    _check(per_node, speeds)
    Links(len(per_node), max(per_node), cross_mbit)  # the rate's own checks
    rates = [w * s for w, s in zip(per_node, speeds, strict=True)]
    whole = sum(rates)
    compute = work.compute_s / whole
    groups = len(per_node)
    param_bytes = stats.params * FP32
    exchange = 0.0
    if groups > 1:  # the leaders' all-reduce of full tensors, once per boundary
        exchange = (_ar(groups) * param_bytes * 8 / (cross_mbit * 1e6)
                    + 2 * (groups - 1) * latency_s) / every
    shares = [NodeShare(i, w, s, r / whole, compute) for i, (w, s, r)
              in enumerate(zip(per_node, speeds, rates, strict=True))]
    equal = work.compute_s / groups / min(rates) + exchange
    size = max(set(per_node), key=lambda k: (sum(w == k for w in per_node) * k, k))
    kept = [i for i, w in enumerate(per_node) if w == size]
    slow = min(speeds[i] for i in kept)  # a uniform mesh runs at its slowest device
    leave_out = work.compute_s / (len(kept) * size * slow) + (
        exchange if len(kept) > 1 else 0.0)
    return GroupsPlan(shares, compute + exchange, compute, exchange, equal, leave_out,
                      [i for i in range(groups) if i not in kept])
