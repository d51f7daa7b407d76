"""MeshSpec: the named mesh dims a run asks for, validated before any worker starts.

The dims go from outer to inner: ``pp, dp_replicate, dp_shard, cp, tp``. Inner dims carry
the most traffic (tp every layer, cp every attention, dp_shard every parameter gather), so
they are laid out on consecutive ranks, which Ray places on the same node.

A dim is a positive int, ``-1`` (inferred from the world size; at most one), or ``"nodes"``
(outer dims only: as many as there are nodes), so that ``MeshSpec.hsdp()`` says "replicate
across nodes, shard inside a node" without knowing the cluster yet.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray_mesh.core.yaml_load import load_yaml
from ray_mesh.errors import MeshSpecError

DIM_NAMES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh dims, outer to inner.

Stability: stable
"""

FLATTENED_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}
"""Flattened dims built on every mesh: data loading (dp), FSDP (dp_shard_cp), loss (dp_cp).

Stability: stable
"""

INNER_DIMS: tuple[str, ...] = ("dp_shard", "cp", "tp")
OUTER_DIMS: tuple[str, ...] = ("pp", "dp_replicate")
NODES = "nodes"
"""Dim value meaning "one per node"; resolved against the real topology at start."""

SHORTHANDS = ("hsdp", "fsdp", "ddp")

DimValue = int | str


def _check_dim(name: str, value: Any) -> DimValue:
    if isinstance(value, str) and value.strip().lower() == NODES:
        if name not in OUTER_DIMS:
            raise MeshSpecError(
                f"{name}='nodes' is not allowed: only the outer dims {OUTER_DIMS} may follow "
                f"the node count; inner dims {INNER_DIMS} must stay inside a node. "
                f"Give {name} a positive int or -1."
            )
        return NODES
    if isinstance(value, bool) or not isinstance(value, int):
        raise MeshSpecError(
            f"{name}={value!r} is not a dim size: use a positive int, -1 to infer it from the "
            f"number of workers" + (", or 'nodes'." if name in OUTER_DIMS else ".")
        )
    if value == 0 or value < -1:
        raise MeshSpecError(
            f"{name}={value} is not a dim size: sizes are positive ints (1 turns the dim off), "
            f"or -1 to infer it from the number of workers."
        )
    return value


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the named mesh dims, outer to inner.

    ``dp_shard=-1`` by default: plain FSDP over every worker, the layout that needs no
    thought. Use :meth:`hsdp` for replicate-across-nodes, shard-inside-a-node.

    Stability: stable
    """

    pp: DimValue = 1
    dp_replicate: DimValue = 1
    dp_shard: DimValue = -1
    cp: DimValue = 1
    tp: DimValue = 1

    def __post_init__(self) -> None:
        for name in DIM_NAMES:
            object.__setattr__(self, name, _check_dim(name, getattr(self, name)))
        inferred = [n for n in DIM_NAMES if getattr(self, n) == -1]
        if len(inferred) > 1:
            raise MeshSpecError(
                f"Only one dim may be -1 (inferred), got {inferred}: give all but one of them "
                f"a size."
            )
        by_nodes = [n for n in DIM_NAMES if getattr(self, n) == NODES]
        if len(by_nodes) > 1:
            raise MeshSpecError(
                f"Only one dim may be 'nodes', got {by_nodes}: give the other a size."
            )

    # ----------------------------------------------------------------- shorthands
    @classmethod
    def hsdp(cls, *, tp: int = 1, cp: int = 1, pp: int = 1) -> MeshSpec:
        """Replicate across nodes, shard inside a node (FSDP2 HSDP on a 2-D mesh).

        ``dp_replicate`` becomes the node count and ``dp_shard`` the workers per node divided
        by ``tp * cp`` when the run starts.
        """
        return cls(pp=pp, dp_replicate=NODES, dp_shard=-1, cp=cp, tp=tp)

    @classmethod
    def fsdp(cls, *, tp: int = 1, cp: int = 1, pp: int = 1) -> MeshSpec:
        """Shard over every data-parallel rank (no replication)."""
        return cls(pp=pp, dp_replicate=1, dp_shard=-1, cp=cp, tp=tp)

    @classmethod
    def ddp(cls, *, tp: int = 1, cp: int = 1, pp: int = 1) -> MeshSpec:
        """Replicate over every data-parallel rank (no sharding)."""
        return cls(pp=pp, dp_replicate=-1, dp_shard=1, cp=cp, tp=tp)

    # ----------------------------------------------------------------- queries
    @property
    def shape(self) -> tuple[DimValue, ...]:
        return tuple(getattr(self, n) for n in DIM_NAMES)

    @property
    def is_resolved(self) -> bool:
        return all(isinstance(v, int) and v > 0 for v in self.shape)

    def size(self, name: str) -> int:
        """Size of a named dim or flattened dim (resolved specs only)."""
        self._require_resolved()
        if name in FLATTENED_DIMS:
            return math.prod(getattr(self, n) for n in FLATTENED_DIMS[name])
        if name not in DIM_NAMES:
            raise MeshSpecError(_unknown_dim_message(name))
        return getattr(self, name)

    @property
    def world_size(self) -> int:
        self._require_resolved()
        return math.prod(self.shape)  # type: ignore[arg-type]

    @property
    def inner_size(self) -> int:
        """tp * cp: the dims that must never leave a node."""
        self._require_resolved()
        return self.tp * self.cp  # type: ignore[operator]

    def inner_split_problem(self, per_node: int, unit: str = "workers") -> str | None:
        """Why tp*cp groups would leave a node of ``per_node`` ranks, or None when they fit.

        The one check behind the Ray plan (:func:`ray_mesh.core.topology.plan_mesh`) and the
        torchrun entry point (:func:`ray_mesh.core.bootstrap.init_mesh`); each adds its fix.
        """
        inner = self.inner_size
        if not per_node % inner:
            return None
        fits = ", ".join(str(d) for d in range(1, per_node + 1) if per_node % d == 0)
        return (f"tp*cp = {self.tp}*{self.cp} = {inner} does not divide the {per_node} {unit} "
                f"per node, so tp/cp groups would cross nodes and every layer's collectives "
                f"would go over the inter-node link. Use tp*cp dividing {per_node} ({fits}), "
                f"or more {unit} per node.")

    def coordinate(self, rank: int) -> dict[str, int]:
        """This rank's index on every named and flattened dim (row-major, like DeviceMesh)."""
        self._require_resolved()
        world = self.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise MeshSpecError(f"rank {rank!r} is not a rank of {self} ({world} ranks): "
                                f"give an int from 0 to {world - 1}.")
        coord: dict[str, int] = {}
        rest = rank
        for name in reversed(DIM_NAMES):
            size = getattr(self, name)
            coord[name] = rest % size
            rest //= size
        for flat, parts in FLATTENED_DIMS.items():
            idx = 0
            for p in parts:
                idx = idx * getattr(self, p) + coord[p]
            coord[flat] = idx
        return {n: coord[n] for n in (*DIM_NAMES, *FLATTENED_DIMS)}

    def _require_resolved(self) -> None:
        if not self.is_resolved:
            raise MeshSpecError(
                f"{self} still has open dims (-1 or 'nodes'): call .resolve(world_size, "
                f"num_nodes) first."
            )

    # ----------------------------------------------------------------- resolution
    def resolve(self, world_size: int, num_nodes: int | None = None) -> MeshSpec:
        """Fill in ``'nodes'`` and ``-1`` and check that the sizes multiply to the world size."""
        _check_count("world_size", world_size, "the number of workers")
        if num_nodes is not None:
            _check_count("num_nodes", num_nodes, "the number of nodes")
        values = {n: getattr(self, n) for n in DIM_NAMES}
        for name, v in values.items():
            if v == NODES:
                if num_nodes is None:
                    raise MeshSpecError(
                        f"{name}='nodes' needs the node count, which is only known when the "
                        f"workers start; pass num_nodes to resolve()."
                    )
                values[name] = num_nodes
        known = math.prod(v for v in values.values() if v != -1)
        open_dims = [n for n, v in values.items() if v == -1]
        if open_dims:
            if world_size % known:
                raise MeshSpecError(
                    f"Cannot infer {open_dims[0]}: {world_size} workers do not divide by the "
                    f"product of the other dims ({_describe(values, skip=open_dims[0])} = "
                    f"{known}). Use a number of workers that is a multiple of {known}, or "
                    f"change the other dims."
                )
            values[open_dims[0]] = world_size // known
        total = math.prod(values.values())
        if total != world_size:
            raise MeshSpecError(
                f"The mesh {_describe(values)} = {total} ranks, but the run has {world_size} "
                f"workers. Set ScalingConfig(num_workers={total}), or set one dim to -1 so it "
                f"is inferred."
            )
        return MeshSpec(**values)

    # ----------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, DimValue]:
        return {n: getattr(self, n) for n in DIM_NAMES}

    @classmethod
    def from_dict(cls, data: Any) -> MeshSpec:
        """Build from a mapping of dim name to size, or a shorthand (``'hsdp'`` etc.)."""
        if isinstance(data, MeshSpec):
            return data
        if data is None:
            return cls()
        if isinstance(data, str):
            return cls._from_shorthand(data, {})
        if not isinstance(data, dict):
            raise MeshSpecError(
                f"A mesh is a mapping of dim name to size (e.g. {{dp_replicate: 2, dp_shard: "
                f"-1}}) or one of {SHORTHANDS}, got {type(data).__name__}: {data!r}."
            )
        data = dict(data)
        layout = data.pop("layout", None)
        unknown = [k for k in data if k not in DIM_NAMES]
        if unknown:
            raise MeshSpecError("; ".join(_unknown_dim_message(k) for k in unknown))
        if layout is not None:
            return cls._from_shorthand(layout, data)
        return cls(**data)

    @classmethod
    def _from_shorthand(cls, name: str, extra: dict[str, Any]) -> MeshSpec:
        key = str(name).strip().lower()
        if key not in SHORTHANDS:
            raise MeshSpecError(
                f"Unknown mesh layout {name!r}: use one of {SHORTHANDS}, or a mapping of dim "
                f"sizes."
            )
        bad = [k for k in extra if k not in ("tp", "cp", "pp")]
        if bad:
            raise MeshSpecError(
                f"layout {key!r} sets dp_replicate and dp_shard itself; with it, give only "
                f"tp, cp or pp (got {bad})."
            )
        return getattr(cls, key)(**extra)

    @classmethod
    def from_yaml(cls, source: str | Path) -> MeshSpec:
        """Parse YAML text or a YAML file holding the mapping (or a top-level ``mesh:`` key)."""
        data = load_yaml(source)
        if isinstance(data, dict) and "mesh" in data and len(data) == 1:
            data = data["mesh"]
        return cls.from_dict(data)

    def __str__(self) -> str:
        return "MeshSpec(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in DIM_NAMES) + ")"


def _check_count(name: str, value: Any, what: str) -> None:
    """A count must be a real int >= 1 (not a bool, float, string or NaN)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MeshSpecError(f"{name} must be an int >= 1 ({what}), got {value!r}.")


def _describe(values: dict[str, Any], skip: str | None = None) -> str:
    return " x ".join(f"{n}={v}" for n, v in values.items() if n != skip)


def _unknown_dim_message(name: str) -> str:
    known = (*DIM_NAMES, *FLATTENED_DIMS)
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Unknown mesh dim {name!r}.{hint} The dims are {DIM_NAMES}."


__all__ = ["DIM_NAMES", "FLATTENED_DIMS", "MeshSpec"]
