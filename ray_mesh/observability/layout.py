"""The mesh layout of a run (rank -> node, IP, interface, device, coordinate) as files.

Rank 0 prints the layout table at start; this module also saves it next to the run's
results (``<storage_path>/<run name>/ray_mesh_layout.json`` and ``.md``), so that
``ray-mesh status``, a human after the run, and tools can see which rank sat where without
scraping logs. Writing goes through the run's own ``StorageContext`` filesystem (Ray
Train's, so cloud storage works as well as a local path) on rank 0's worker, called by the
backend right after bring-up. A failure to save only logs a warning: the layout is a view,
not a reason to stop a run.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from typing import Any

from ray_mesh.core.spec import DIM_NAMES
from ray_mesh.core.topology import MeshPlan

logger = logging.getLogger(__name__)

LAYOUT_JSON = "ray_mesh_layout.json"
LAYOUT_MD = "ray_mesh_layout.md"
SAVE_TIMEOUT_S = 30.0
COLUMNS: tuple[str, ...] = ("rank", "node", "node_ip", "hostname", "local_rank", "device",
                            "interface", *DIM_NAMES)


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
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in doc["ranks"]]
    if doc.get("warnings"):
        lines += ["", "Warnings:", *(f"- {w}" for w in doc["warnings"])]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- Ray side
def _write_on_worker(doc: dict[str, Any]) -> str:
    """Runs on rank 0's worker: write both files into the run directory; returns its path."""
    import ray.train

    from ray_mesh.checkpointing.storage import check_run_name

    storage = ray.train.get_context().get_storage()
    check_run_name(storage.experiment_dir_name)  # never write outside storage_path
    fs, run_dir = storage.storage_filesystem, storage.experiment_fs_path
    doc = {**doc, "run": doc.get("run") or storage.experiment_dir_name}
    fs.create_dir(run_dir, recursive=True)
    for name, text in ((LAYOUT_JSON, json.dumps(doc, indent=2) + "\n"),
                       (LAYOUT_MD, to_markdown(doc))):
        with fs.open_output_stream(f"{run_dir}/{name}") as out:
            out.write(text.encode())
    return run_dir


def save_layout(worker_group, plan: MeshPlan, interfaces: dict[int, str]) -> str | None:
    """From the backend (controller): have rank 0 save the layout. Never raises."""
    try:
        doc = layout_document(plan, interfaces)
        import ray

        # Bounded: slow storage must not hold up the start of training for long.
        ref = worker_group.execute_single_async(0, _write_on_worker, doc)
        run_dir = ray.get(ref, timeout=SAVE_TIMEOUT_S)
        logger.info("ray_mesh: mesh layout saved to %s/%s (and .md)", run_dir, LAYOUT_JSON)
        return run_dir
    except Exception as exc:  # noqa: BLE001 - a view must not stop the run
        logger.warning("ray_mesh: could not save the mesh layout (%s: %s); the run goes on, "
                       "the layout table is in rank 0's log.", type(exc).__name__, exc)
        return None


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


__all__ = ["LAYOUT_JSON", "LAYOUT_MD", "layout_document", "read_layout", "save_layout",
           "to_markdown"]
