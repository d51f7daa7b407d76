"""What each replica group is: its inner layout and, optionally, the node it runs on.

A uniform run gives every group the same layout (``groups=3, workers_per_group=2``). Unequal
boxes give each its own: a 2-device node ``{"dp_shard": 2}``, a 1-device node
``{"dp_shard": 1}``, a node where the model is split ``{"tp": 2}``. Groups of one layout
exchange shard with shard; as soon as two differ, every exchange is of full tensors
(:mod:`.reshard`), chosen here once for the whole run so that every group agrees.

A group pinned to a node (``node``: the node's address as Ray knows it) asks for Ray's
``node:<address>`` resource, so a 1-worker group cannot take half of a 2-slot node and leave
a 2-worker group with nowhere to go. Plain data and checks: the planner
(:mod:`ray_mesh.planning.groups`) and the job file build these; the Ray glue reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_mesh.errors import GroupLayoutError

INNER_DIMS = ("dp_shard", "cp", "tp")  # dp_replicate is the groups; pp is not split by group


@dataclass(frozen=True)
class GroupSpec:
    """One replica group: its inner mesh (dim -> size) and the node it is pinned to.

    Stability: experimental
    """

    mesh: Mapping[str, int] = field(default_factory=lambda: {"dp_shard": 1})
    node: str | None = None

    @property
    def workers(self) -> int:
        return math.prod(self.mesh.values())

    @property
    def label(self) -> str:
        """``dp_shard=2`` / ``tp=2,dp_shard=2``: the layout as status lines show it."""
        return ",".join(f"{d}={n}" for d, n in self.mesh.items())

    def to_dict(self) -> dict[str, Any]:
        return {"mesh": dict(self.mesh), **({"node": self.node} if self.node else {})}


def _check_mesh(i: int, mesh: Any) -> dict[str, int]:
    if not isinstance(mesh, Mapping) or not mesh:
        raise GroupLayoutError(f"replica group {i}: its layout must be a mapping of dim sizes "
                               f"such as {{dp_shard: 2}}, got {mesh!r}")
    out = {}
    for dim, size in mesh.items():
        if dim not in INNER_DIMS:
            raise GroupLayoutError(
                f"replica group {i}: dim {dim!r} is not a dim inside a group; use "
                f"{', '.join(INNER_DIMS)} (dp_replicate is the groups themselves)")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise GroupLayoutError(f"replica group {i}: {dim}={size!r}: give a whole number "
                                   "of workers, at least 1 (-1 is not known before the group "
                                   "is placed)")
        out[str(dim)] = size
    # Node-aligned order, innermost last, as MeshSpec builds it.
    return {d: out[d] for d in ("dp_shard", "cp", "tp") if d in out}


def group_specs(groups: int | Sequence[GroupSpec | Mapping[str, Any]],
                workers_per_group: int | None = None) -> list[GroupSpec]:
    """The groups of a run: ``groups`` equal ones of ``workers_per_group`` (``dp_shard``
    over them), or one per entry: a :class:`GroupSpec`, a mapping ``{mesh: {...}, node:
    ip}`` or a bare mesh mapping ``{dp_shard: 2}``."""
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 1 or not isinstance(workers_per_group, int) or workers_per_group < 1:
            raise GroupLayoutError(f"groups={groups}, workers_per_group={workers_per_group}: "
                                   "both must be at least 1")
        return [GroupSpec({"dp_shard": workers_per_group}) for _ in range(groups)]
    if workers_per_group is not None:
        raise GroupLayoutError("workers_per_group goes with groups=N; with a list of group "
                               "layouts each group's size is its layout's product")
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise GroupLayoutError(f"groups={groups!r}: give a number of groups or a list of "
                               "group layouts such as [{dp_shard: 2}, {dp_shard: 1}]")
    out = []
    for i, g in enumerate(groups):
        if isinstance(g, GroupSpec):
            out.append(GroupSpec(_check_mesh(i, dict(g.mesh)), g.node))
        elif isinstance(g, Mapping) and "mesh" in g:
            if extra := set(g) - {"mesh", "node"}:
                raise GroupLayoutError(f"replica group {i}: unknown key(s) {sorted(extra)}; "
                                       "a group has mesh and node")
            node = g.get("node")
            if node is not None and (not isinstance(node, str) or not node):
                raise GroupLayoutError(f"replica group {i}: node={node!r}: give the node's "
                                       "address as Ray lists it (ray status / ray-mesh doctor)")
            out.append(GroupSpec(_check_mesh(i, g["mesh"]), node))
        else:
            out.append(GroupSpec(_check_mesh(i, g)))
    return out


def exchange_for(specs: Sequence[GroupSpec]) -> str:
    """``"shards"`` when every group has the same layout, else ``"full"`` (:mod:`.reshard`)."""
    return "shards" if len({s.label for s in specs}) <= 1 else "full"


__all__ = ["GroupSpec"]
