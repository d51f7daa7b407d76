"""The mesh layout of a run (rank -> node, IP, interface, device, coordinate) as text.

Rank 0 prints :func:`layout_table` at start; the same rows are saved next to the run's
results (``<storage_path>/<run name>/ray_mesh_layout.json`` and ``.md``, written by
``ray_mesh.raytrain.layout_io`` through Ray Train's storage), so that ``ray-mesh status``, a
human after the run, and tools can see which rank sat where without scraping logs. This
module only builds and reads those documents: no Ray.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

from ray_mesh.core.spec import DIM_NAMES
from ray_mesh.core.table import markdown_table, text_table
from ray_mesh.core.topology import MeshPlan
from ray_mesh.network.interfaces import Choice

LAYOUT_JSON = "ray_mesh_layout.json"
LAYOUT_MD = "ray_mesh_layout.md"
COLUMNS: tuple[str, ...] = ("rank", "node", "node_ip", "hostname", "local_rank", "device",
                            "interface", *DIM_NAMES)


def layout_table(plan: MeshPlan, interfaces: dict[int, str] | None = None) -> str:
    """The rank -> node -> coordinate table rank 0 prints at start (and ``ray-mesh plan``)."""
    rows = plan.layout_rows(interfaces)
    title = (f"ray_mesh: {plan.spec}  on {plan.num_nodes} node(s) x {plan.workers_per_node} "
             f"worker(s)")
    return title + "\n" + text_table(rows, list(rows[0]))


def layout_document(plan: MeshPlan, interfaces: dict[int, str] | None = None,
                    run: str = "") -> dict[str, Any]:
    """A JSON-ready description of where every rank of ``plan`` sits."""
    rows = plan.layout_rows(interfaces)
    for row, worker in zip(rows, plan.workers, strict=True):
        row["hostname"] = worker.hostname
        row["node_id"] = worker.node_id
    return {
        "run": run,
        "mesh": str(plan.spec),
        "shape": dict(zip(DIM_NAMES, plan.spec.shape, strict=True)),
        "num_nodes": plan.num_nodes,
        "workers_per_node": plan.workers_per_node,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "warnings": list(plan.warnings),
        "ranks": rows,
    }


def to_markdown(doc: dict[str, Any]) -> str:
    """The layout as a Markdown table (the same columns as the log table, plus hostname)."""
    cols = [c for c in COLUMNS if any(c in r for r in doc["ranks"])]
    lines = [
        f"# ray_mesh layout: {doc.get('run') or 'run'}",
        "",
        f"{doc['mesh']} on {doc['num_nodes']} node(s) x {doc['workers_per_node']} worker(s); "
        f"written {doc['created']}.",
        "",
        markdown_table(doc["ranks"], cols),
    ]
    if doc.get("warnings"):
        lines += ["", "Warnings:", *(f"- {w}" for w in doc["warnings"])]
    return "\n".join(lines) + "\n"


def node_lines(plan: MeshPlan, choices: list[Choice]) -> str:
    """One line per node: the interface its ranks use, why, and which ranks sit there."""
    lines = []
    for node in range(plan.num_nodes):
        ranks = [w.rank for w in plan.workers if plan.node_rank(w.rank) == node]
        c, ip = choices[ranks[0]], plan.workers[ranks[0]].node_ip
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
        lines.append(f"ray_mesh: node {node} ({ip}): ranks {span} use interface "
                     f"{c.interface} [{c.reason}], address {c.address}")
    return "\n".join(lines)


def read_layout(storage_path: str, run: str) -> dict[str, Any] | None:
    """The saved layout of run ``run`` under ``storage_path`` (local or URI), or None."""
    try:
        import pyarrow.fs

        fs, base = pyarrow.fs.FileSystem.from_uri(storage_path)
    except Exception:  # noqa: BLE001 - a plain local path
        import pyarrow.fs

        fs, base = pyarrow.fs.LocalFileSystem(), storage_path
    try:
        with fs.open_input_stream(f"{base.rstrip('/')}/{run}/{LAYOUT_JSON}") as f:
            return json.loads(f.read().decode())
    except Exception:  # noqa: BLE001 - not written (yet), or storage not reachable from here
        return None


__all__ = ["LAYOUT_JSON", "LAYOUT_MD", "layout_document", "layout_table", "read_layout",
           "to_markdown"]
