"""What the cluster has, and the mesh ``ray-mesh plan`` proposes for it (no Ray).

A mesh needs the same number of workers on every node (see ``topology.plan_mesh``), but
real clusters mix boxes: an 8-GPU server, two 4-GPU ones, a laptop with one. This module
groups the nodes into homogeneous sets, picks the set (and per-node worker count) that
gives the most workers, and says which nodes it leaves out and why. It is plain Python
over :class:`NodeInfo` records; listing the live nodes and the doctor's node agents, which
talk to Ray, live in ``ray_mesh.raytrain.cluster``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray_mesh.private_apis as private_apis
from ray_mesh.core.layout import Layout, LayoutError, check_family, family_mesh
from ray_mesh.core.spec import MeshSpecError
from ray_mesh.core.table import text_table
from ray_mesh.core.topology import MeshPlan, TopologyError, WorkerReport, plan_mesh
from ray_mesh.observability.layout import layout_table

_BUILTIN = ("CPU", "GPU", "memory", "object_store_memory")


@dataclass(frozen=True)
class NodeInfo:
    """One node of the cluster as Ray reports it."""

    node_id: str
    ip: str
    hostname: str = ""
    gpus: float = 0
    cpus: float = 0
    resources: Mapping[str, float] = field(default_factory=dict)  # custom ones only
    accelerator: str = ""  # Ray's accelerator_type, e.g. "A100"
    alive: bool = True
    is_head: bool = False

    def amount(self, resource: str) -> float:
        if resource == "GPU":
            return self.gpus
        if resource == "CPU":
            return self.cpus
        return float(self.resources.get(resource, 0))

    @property
    def label(self) -> str:
        host = f", {self.hostname}" if self.hostname and self.hostname != self.ip else ""
        return f"{self.ip}{host}"


def nodes_from_ray(raw: Sequence[Mapping[str, Any]]) -> list[NodeInfo]:
    """Turn ``ray.nodes()`` records into :class:`NodeInfo` (dead nodes kept, marked)."""
    out = []
    for n in raw:
        res = dict(n.get("Resources") or {})
        accel = next((k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")), "")
        custom = {k: v for k, v in res.items()
                  if k not in _BUILTIN and not k.startswith(("node:", "accelerator_type:"))}
        out.append(NodeInfo(
            node_id=n["NodeID"], ip=n.get("NodeManagerAddress", ""),
            hostname=n.get("NodeManagerHostname", ""), gpus=res.get("GPU", 0),
            cpus=res.get("CPU", 0), resources=custom, accelerator=accel,
            alive=bool(n.get("Alive", False)), is_head=private_apis.is_head_node(res),
        ))
    # Head first, then by address: a stable order for rank -> node tables.
    return sorted(out, key=lambda x: (not x.is_head, x.ip))


def group_nodes(nodes: Sequence[NodeInfo], resource: str = "GPU") -> dict[tuple, list[NodeInfo]]:
    """Alive nodes grouped into homogeneous sets: same accelerator and same ``resource``."""
    groups: dict[tuple, list[NodeInfo]] = defaultdict(list)
    for n in nodes:
        if n.alive:
            groups[(n.accelerator, n.amount(resource))].append(n)
    return dict(groups)


@dataclass
class ClusterPlan:
    """The layout ``ray-mesh plan`` proposes and where it runs: nodes used, nodes left out
    (with why), and the rank -> node placement (``mesh``, whose spec is the layout's dims)."""

    family: str
    resource: str
    per_node: int
    used: list[NodeInfo]
    left_out: list[tuple[NodeInfo, str]]
    mesh: MeshPlan
    notes: list[str] = field(default_factory=list)

    @property
    def num_workers(self) -> int:
        return self.per_node * len(self.used)

    def scaling_hint(self) -> str:
        if self.resource == "GPU":
            return f"ScalingConfig(num_workers={self.num_workers}, use_gpu=True)"
        return (f"ScalingConfig(num_workers={self.num_workers}, "
                f"resources_per_worker={{'{self.resource}': 1}})")

    @property
    def layout(self) -> Layout:
        """The proposed layout (fp32, sync: the family fixes only the dims)."""
        return Layout(self.mesh.spec)

    def format(self) -> str:
        s = self.mesh.spec
        lines = [
            f"family {self.family}: {len(self.used)} node(s) x {self.per_node} worker(s) "
            f"per node ({self.resource}) = {self.num_workers} workers",
            f"layout: {self.layout}",
            f"run with: {self.scaling_hint()} and MeshConfig(mesh={s.to_dict()})",
            "",
            "nodes used:",
        ]
        for i, n in enumerate(self.used):
            extra = f", {n.accelerator}" if n.accelerator else ""
            lines.append(f"  node {i}: {n.label} ({n.amount(self.resource):g} {self.resource}, "
                         f"{n.cpus:g} CPU{extra}) -> ranks {i * self.per_node}.."
                         f"{(i + 1) * self.per_node - 1}")
        if self.left_out:
            lines.append("nodes left out:")
            lines += [f"  {n.label}: {why}" for n, why in self.left_out]
        lines += ["", layout_table(self.mesh)]
        if self.mesh.warnings or self.notes:
            lines.append("")
            lines += [f"note: {w}" for w in (*self.notes, *self.mesh.warnings)]
        return "\n".join(lines)


def _candidates(nodes: Sequence[NodeInfo], resource: str) -> list[tuple[str, int, list]]:
    """(accelerator, workers per node, nodes that can host that many), most workers first."""
    alive = [n for n in nodes if n.alive and n.amount(resource) >= 1]
    out = []
    for accel in sorted({n.accelerator for n in alive}):
        same = [n for n in alive if n.accelerator == accel]
        for k in sorted({int(n.amount(resource)) for n in same}, reverse=True):
            hosts = [n for n in same if n.amount(resource) >= k]
            out.append((accel, k, hosts))
    # Most workers; then more per node (fewer, fuller nodes: less cross-node traffic).
    return sorted(out, key=lambda c: (-c[1] * len(c[2]), -c[1]))


def plan_cluster(
    nodes: Sequence[NodeInfo],
    family: str = "hsdp",
    *,
    resource: str = "GPU",
    tp: int | None = None,
    pp: int | None = None,
    allow_cross_node_inner: bool = False,
) -> ClusterPlan:
    """Propose a layout of ``family`` (:data:`ray_mesh.core.layout.FAMILIES`) for ``nodes``;
    raises :class:`TopologyError` when none fits."""
    check_family(family)
    alive = [n for n in nodes if n.alive]
    if not alive:
        raise TopologyError("The cluster has no live nodes: start Ray on the nodes "
                            "(deploy/tailscale/ray-head.sh and ray-worker.sh).")
    candidates = _candidates(alive, resource)
    if not candidates:
        have = sorted({k for n in alive for k in (*n.resources, "CPU", "GPU")
                       if n.amount(k) >= 1})
        raise TopologyError(
            f"No live node has {resource!r} (resources with at least 1 on some node: "
            f"{', '.join(have)}). Use --resource with one of them (CPU for CPU workers)."
        )
    errors = []
    for accel, k, hosts in candidates:
        try:
            spec = family_mesh(family, len(hosts), k, tp=tp, pp=pp)
            reports = [WorkerReport(rank=r, node_id=hosts[r // k].node_id,
                                    node_ip=hosts[r // k].ip, hostname=hosts[r // k].hostname,
                                    local_rank=r % k,
                                    device=f"cuda:{r % k}" if resource == "GPU" else "cpu")
                       for r in range(k * len(hosts))]
            mesh = plan_mesh(spec, reports, allow_cross_node_inner=allow_cross_node_inner)
        except (MeshSpecError, TopologyError, LayoutError) as exc:
            errors.append(f"{len(hosts)} node(s) x {k}: {exc}")
            continue
        used_ids = {n.node_id for n in hosts}
        left_out = [(n, _why_left_out(n, resource, k, accel)) for n in nodes
                    if n.node_id not in used_ids]
        notes = [f"{n.label} has {n.amount(resource):g} {resource}; the plan uses {k} of them "
                 f"so that every node runs the same number of workers." for n in hosts
                 if n.amount(resource) > k]
        if notes:
            notes.append("Ray places workers itself: on unequal nodes it may not put exactly "
                         f"{k} on each, and ray_mesh then stops with a TopologyError. A custom "
                         f"resource of {k} per node (resources_per_worker={{'slot': 1}}) pins it.")
        return ClusterPlan(family, resource, k, list(hosts), left_out, mesh, notes)
    raise TopologyError(f"No {family} layout fits this cluster:\n  - " + "\n  - ".join(errors)
                        + "\nChange --layout, --tp or --pp, or add matching nodes.")


def _why_left_out(node: NodeInfo, resource: str, k: int, accel: str) -> str:
    if not node.alive:
        return "not alive (Ray lost it); restart Ray there or remove it"
    have = node.amount(resource)
    if have < 1:
        return f"has no {resource}"
    if node.accelerator != accel:
        return (f"its accelerator ({node.accelerator or 'none'}) differs from the chosen "
                f"set's ({accel or 'none'}); a mesh mixes no GPU types")
    return (f"has {have:g} {resource}, fewer than the {k} per node of the chosen set; "
            f"adding it would put unequal numbers of workers on the nodes")


def describe_nodes(nodes: Sequence[NodeInfo], resource: str = "GPU") -> str:
    """The discovery table: id, IP, GPUs, CPUs, custom resources, and the homogeneous sets."""
    rows = [{"node_id": n.node_id[:12], "address": n.label, "GPU": n.gpus, "CPU": n.cpus,
             "resources": ", ".join(f"{k}={v:g}" for k, v in sorted(n.resources.items())),
             "role": "head" if n.is_head else "", "state": "alive" if n.alive else "DEAD"}
            for n in nodes]
    lines = ["nodes:", text_table(rows, ["node_id", "address", "GPU", "CPU", "resources",
                                         "role", "state"], indent="  ")]
    groups = group_nodes(nodes, resource)
    lines.append(f"homogeneous sets (by accelerator and {resource}):")
    for (accel, amount), members in sorted(groups.items(), key=lambda g: -len(g[1])):
        lines.append(f"  {len(members)} node(s) with {amount:g} {resource}"
                     f"{' ' + accel if accel else ''}: {', '.join(m.ip for m in members)}")
    return "\n".join(lines)
