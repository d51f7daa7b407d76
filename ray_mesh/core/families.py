"""Layout families: shapes relative to the cluster, which become a layout's dims on one.

A family (``ddp``, ``fsdp``, ``hsdp``, ``tp_hsdp``, ``pp``, ``tp_pp``, ``pp_tp_hsdp``) says how
the dims follow the cluster ("replicate across nodes, shard inside"), not their sizes:
:func:`family_mesh` gives them for N nodes x G workers, and
:attr:`ray_mesh.core.layout.Layout.family` names the family of given dims. Families are what
``plan.layouts`` lists and ``ray-mesh plan --layout`` proposes. Split from
:mod:`ray_mesh.core.layout`, which re-exports these names.
"""

from __future__ import annotations

from typing import Any

from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.errors import LayoutError

FAMILIES = ("ddp", "fsdp", "hsdp", "tp_hsdp", "pp", "tp_pp", "pp_tp_hsdp")
"""Layout families: shapes relative to the cluster (:func:`family_mesh`)."""

OLD_FAMILY_SPELLINGS = {"tp-dp": "tp_hsdp", "tp_dp": "tp_hsdp", "tp-pp": "tp_pp",
                        "pp-hsdp-tp": "pp_tp_hsdp", "tp-hsdp": "tp_hsdp"}
"""Hyphenated and near spellings of the families: refused with the family meant
(:func:`check_family`)."""


def check_family(name: Any) -> str:
    """``name`` if it is a family; an old spelling or a typo raises naming the family."""
    if name in FAMILIES:
        return name
    new = OLD_FAMILY_SPELLINGS.get(str(name))
    if new is not None:
        raise LayoutError(f"layout family {name!r} is now spelled {new!r} (the families: "
                          f"{', '.join(FAMILIES)})")
    raise LayoutError(f"unknown layout family {name!r}; choose from {', '.join(FAMILIES)}")


def family_mesh(family: str, nodes: int, per_node: int, *, tp: int | None = None,
                pp: int | None = None) -> MeshSpec:
    """The dims of ``family`` on ``nodes`` x ``per_node`` workers (resolved).

    ddp: replicate everywhere; fsdp: shard everywhere; hsdp: replicate across nodes, shard
    inside; tp_hsdp: tp inside a node (``tp``, default the whole node), HSDP over the rest;
    pp: one stage per node (or ``pp``), FSDP inside; tp_pp: one stage per node, tp inside;
    pp_tp_hsdp: ``pp`` stages (2 when the node count is even), ``tp`` (2 when a node's
    workers are even) inside a node, HSDP over the rest.
    """
    check_family(family)
    world = nodes * per_node
    if family == "hsdp" and (tp or 1) > 1:
        family = "tp_hsdp"  # HSDP with tp inside a node is that family
    if family in ("ddp", "fsdp") and (tp or 1) > 1:
        raise LayoutError(f"{family} has no tensor parallel dim; for tp={tp} use the family "
                          "tp_hsdp (tp inside a node) or tp_pp")
    t = tp or (per_node if family in ("tp_hsdp", "tp_pp") else 1)
    if family == "pp_tp_hsdp" and tp is None:
        t = 2 if per_node % 2 == 0 else 1
    if per_node % t:
        raise LayoutError(f"tp={t} does not divide the {per_node} workers per node: give a tp "
                          f"that divides {per_node}")
    p = pp or (nodes if family in ("pp", "tp_pp") else
               (2 if nodes % 2 == 0 else 1) if family == "pp_tp_hsdp" else 1)
    if nodes % p:
        raise LayoutError(f"pp={p} does not divide the {nodes} nodes: give a pp that divides "
                          f"{nodes} (stages across nodes)")
    dims = {"ddp": {"dp_replicate": world // p},
            "fsdp": {"dp_shard": world // p},
            "hsdp": {"dp_replicate": nodes // p, "dp_shard": per_node},
            "tp_hsdp": {"dp_replicate": nodes // p, "dp_shard": per_node // t, "tp": t},
            "pp": {"dp_replicate": nodes // p, "dp_shard": per_node},
            "tp_pp": {"dp_replicate": nodes // p, "dp_shard": per_node // t, "tp": t},
            "pp_tp_hsdp": {"dp_replicate": nodes // p, "dp_shard": per_node // t, "tp": t},
            }[family]
    dims = {"pp": p, **dims}
    return MeshSpec(**{d: dims.get(d, 1) for d in DIM_NAMES})
