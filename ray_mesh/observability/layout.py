"""The mesh layout of a run (rank -> node, IP, interface, device, coordinate) as text.

Rank 0 prints :func:`layout_table` at start; the same rows are saved next to the run's
results (``<storage_path>/<run name>/ray_mesh_layout.json`` and ``.md``, written by
``ray_mesh.raytrain.layout_io`` through Ray Train's storage), so that ``ray-mesh status``, a
human after the run, and tools can see which rank sat where without scraping logs. This
module only builds and reads those documents: no Ray. ``ray-mesh status`` reads one only
from storage the viewer named (:func:`read_run_layout`), bounded and checked.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from typing import Any

from ray_mesh.core.layout import Layout
from ray_mesh.core.object_store import redacted, same_location
from ray_mesh.core.safe import safe_text
from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.core.table import markdown_table, text_table
from ray_mesh.core.topology import MeshPlan
from ray_mesh.network.interfaces import Choice
from ray_mesh.observability import status_input as si
from ray_mesh.observability.fetch import Deadline, SourceError, patiently, read_storage_file

LAYOUT_JSON = "ray_mesh_layout.json"
LAYOUT_MD = "ray_mesh_layout.md"
COLUMNS: tuple[str, ...] = ("rank", "node", "node_ip", "hostname", "local_rank", "device",
                            "interface", *DIM_NAMES)


def layout_table(plan: MeshPlan, interfaces: dict[int, str] | None = None,
                 layout: Layout | None = None) -> str:
    """The rank -> node -> coordinate table rank 0 prints at start (and ``ray-mesh plan``),
    titled with the run's layout (default: the plan's dims, fp32, sync)."""
    rows = plan.layout_rows(interfaces)
    title = (f"ray_mesh: layout {layout or Layout(plan.spec)}  on {plan.num_nodes} node(s) x "
             f"{plan.workers_per_node} worker(s)")
    return title + "\n" + text_table(rows, list(rows[0]))


def layout_document(plan: MeshPlan, interfaces: dict[int, str] | None = None,
                    run: str = "", layout: Layout | None = None) -> dict[str, Any]:
    """A JSON-ready description of where every rank of ``plan`` sits, and the run's
    :class:`~ray_mesh.core.layout.Layout` as its canonical string (``layout``; default: the
    plan's dims, fp32, sync)."""
    rows = plan.layout_rows(interfaces)
    for row, worker in zip(rows, plan.workers, strict=True):
        row["hostname"] = worker.hostname
        row["node_id"] = worker.node_id
    return {
        "run": run,
        "layout": str(layout or Layout(plan.spec)),
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
        f"{doc.get('layout') or doc['mesh']} on {doc['num_nodes']} node(s) x "
        f"{doc['workers_per_node']} worker(s); written {doc['created']}.",
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


LAYOUT_MAX_BYTES = 32 * 2**20


def read_layout(storage_path: str, run: str, *, timeout_s: float = 30.0,
                max_bytes: int = LAYOUT_MAX_BYTES) -> dict[str, Any] | None:
    """The saved layout of run ``run`` under ``storage_path`` (local or URI), or None.

    Read bounded (size and time), but not checked: for storage the caller trusts (its own
    run's). ``ray-mesh status`` uses :func:`read_run_layout`.
    """
    try:
        data = read_storage_file(storage_path, f"{run}/{LAYOUT_JSON}", timeout_s=timeout_s,
                                 max_bytes=max_bytes, what=LAYOUT_JSON)
        return json.loads(data.decode()) if data else None
    except Exception:  # noqa: BLE001 - not written (yet), unreadable, or storage not reachable
        return None


def layout_from_state(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Layout rows from a checked Train state run's workers and mesh spec (no interfaces;
    see :func:`ray_mesh.observability.status_input.parse_run`)."""
    workers = run["workers"]
    if not workers:
        return []
    nodes = sorted({w["node"] for w in workers})
    try:
        spec = MeshSpec.from_dict(run["mesh"]).resolve(len(workers), num_nodes=len(nodes))
        coords = {w["rank"]: spec.coordinate(w["rank"]) for w in workers}
    except Exception:  # noqa: BLE001 - show placement without coordinates
        coords = {}
    return [{**w, "interface": "?", **{d: coords.get(w["rank"], {}).get(d, "")
                                       for d in DIM_NAMES}} for w in workers]


def named_storage(path: str | None, storage: Sequence[str]) -> str | None:
    """The viewer's spelling of ``path`` if the viewer named it (a trailing '/' aside; for a
    URI also pyarrow's ``?endpoint_override=`` options, which only say how to reach it)."""
    if path is None:
        return None
    for s in storage:
        if s.rstrip("/") == path.rstrip("/") or (
                "://" in s and "://" in path and same_location(s, path)):
            return s
    return None


def read_run_file(named: str, run_name: str, filename: str, parse: Any, timeout_s: float,
                  max_bytes: int, endpoint: str | None = None,
                  deadline: Deadline | None = None) -> Any:
    """``<named>/<run_name>/<filename>`` (storage the viewer named), bounded (with a
    ``deadline``: asked again once if slow, :func:`patiently`), through ``parse(data,
    what)``; None when absent. Raises Malformed or SourceError."""
    what = safe_text(f"{redacted(named)}/{run_name}/{filename}", 300)  # no query values

    def ask(bound_s: float) -> bytes | None:
        return read_storage_file(named, f"{run_name}/{filename}", timeout_s=bound_s,
                                 max_bytes=max_bytes, what=what,
                                 endpoint=endpoint if named.startswith("s3://") else None)

    data = patiently(ask, timeout_s, deadline, what)
    return None if data is None else parse(data, what)


def read_run_layout(run: dict[str, Any], storage: Sequence[str], timeout_s: float,
                    max_bytes: int, endpoint: str | None = None,
                    deadline: Deadline | None = None
                    ) -> tuple[dict[str, Any] | None, str | None]:
    """A checked run's layout file, read only when the viewer named its storage (a URI
    opens with this machine's cloud credentials); else (None, why not), for a note."""
    raw, name, shown = run["storage_raw"], run["name"], run["storage_path"]
    named = named_storage(raw, storage)
    if raw is None:
        return None, None
    if named is None:
        return None, (f"layout files are in {shown}, storage the cluster reports: not opened, "
                      f"so this machine's credentials are not used on a place the cluster "
                      f"chose. If that is storage you trust, name it: --storage {shown}")
    if not si.safe_component(name):
        return None, (f"run {name}: its name cannot be a path component under {shown}: "
                      f"layout file not read")
    try:
        return read_run_file(named, name, LAYOUT_JSON, si.parse_layout, timeout_s, max_bytes,
                             endpoint, deadline), None
    except si.Malformed as exc:
        return None, f"run {name}: layout file malformed ({exc}); layout from train state"
    except SourceError as exc:
        return None, f"run {name}: layout file not read ({exc}); layout from train state"
