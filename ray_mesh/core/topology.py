"""What the workers report about themselves, and the plan that fits the mesh onto them.

Plain Python: the planner takes worker reports (from Ray, from a test, from
``ray-mesh plan``) and answers which mesh runs where, or why it cannot. Ray orders ranks
by node, but does not promise the same number of workers on each node; this module checks
that, and that the inner dims (tp, cp, then dp_shard) stay inside a node.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field

from ray_mesh.core.spec import DIM_NAMES, MeshSpec, MeshSpecError
from ray_mesh.errors import TopologyError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerReport:
    """One worker's answer to the start-up probe."""

    rank: int
    node_id: str
    node_ip: str
    hostname: str = ""
    local_rank: int = 0
    device: str = "cpu"
    interfaces: dict[str, list[str]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MeshPlan:
    """A resolved mesh on a concrete set of workers."""

    spec: MeshSpec
    workers: tuple[WorkerReport, ...]
    node_ids: tuple[str, ...]  # in rank order
    workers_per_node: int
    warnings: tuple[str, ...] = ()

    @property
    def num_nodes(self) -> int:
        return len(self.node_ids)

    def node_rank(self, rank: int) -> int:
        return self.node_ids.index(self.workers[rank].node_id)

    def layout_rows(self, interfaces: dict[int, str] | None = None) -> list[dict]:
        rows = []
        for w in self.workers:
            coord = self.spec.coordinate(w.rank)
            row = {"rank": w.rank, "node": self.node_rank(w.rank), "node_ip": w.node_ip,
                   "local_rank": w.local_rank, "device": w.device,
                   "interface": (interfaces or {}).get(w.rank, "")}
            row.update({d: coord[d] for d in DIM_NAMES})
            rows.append(row)
        return rows


def plan_mesh(
    spec: MeshSpec,
    workers: list[WorkerReport],
    *,
    allow_cross_node_inner: bool = False,
) -> MeshPlan:
    """Resolve ``spec`` on ``workers`` (ordered by rank) and check node alignment."""
    if not workers:
        raise TopologyError("No workers to plan the mesh on: the worker group is empty. Ask "
                            "for at least one worker (ScalingConfig(num_workers=...)).")
    workers = sorted(workers, key=lambda w: w.rank)
    if [w.rank for w in workers] != list(range(len(workers))):
        raise TopologyError(f"Worker ranks must be 0..{len(workers) - 1}, got "
                            f"{[w.rank for w in workers]}.")
    world = len(workers)
    counts = Counter(w.node_id for w in workers)
    node_ids = tuple(dict.fromkeys(w.node_id for w in workers))
    ip_of = {w.node_id: w.node_ip for w in workers}
    if len(set(counts.values())) > 1:
        per = ", ".join(f"{ip_of[n]} ({n[:8]}): {counts[n]}" for n in node_ids)
        raise TopologyError(
            f"Ray placed an unequal number of workers on the nodes ({per}). The mesh needs "
            f"the same number on every node. Ask for resources only whole nodes can give: "
            f"ScalingConfig(num_workers={len(node_ids)}*<per node>, use_gpu=True) on nodes with "
            f"equal GPU counts, or a custom resource per node with "
            f"resources_per_worker={{'<resource>': 1}}; or use placement_strategy='STRICT_SPREAD'"
            f" with one worker per node."
        )
    per_node = world // len(node_ids)
    # Ray gives consecutive ranks to a node; the mesh relies on that for node alignment.
    for i, w in enumerate(workers):
        if w.node_id != node_ids[i // per_node]:
            raise TopologyError(
                f"Rank {w.rank} is on node {w.node_ip} but ranks {i // per_node * per_node}.."
                f"{(i // per_node + 1) * per_node - 1} should share one node: ranks are not "
                f"grouped by node, so the inner mesh dims would cross nodes."
            )
    try:
        resolved = spec.resolve(world, num_nodes=len(node_ids))
    except MeshSpecError as exc:
        raise TopologyError(f"{exc} (cluster: {len(node_ids)} node(s) x {per_node} "
                            f"worker(s))") from exc

    warnings: list[str] = []
    inner = resolved.inner_size
    msg = resolved.inner_split_problem(per_node)
    if msg:
        if not allow_cross_node_inner:
            raise TopologyError(msg + " (MeshConfig(allow_cross_node_inner=True) accepts it.)")
        warnings.append(msg)
    shard_span = resolved.dp_shard * inner
    if not msg and shard_span > per_node and len(node_ids) > 1:
        hsdp_shard = per_node // inner
        warnings.append(
            f"dp_shard={resolved.dp_shard} groups span {shard_span // per_node} nodes, so FSDP's "
            f"all-gathers cross nodes every step. HSDP keeps them inside a node: "
            f"MeshSpec.hsdp(tp={resolved.tp}, cp={resolved.cp}) gives dp_replicate="
            f"{world // (hsdp_shard * inner * resolved.pp)}, dp_shard={hsdp_shard}."
        )
    for w in warnings:
        logger.warning("ray_mesh: %s", w)
    return MeshPlan(resolved, tuple(workers), node_ids, per_node, tuple(warnings))
