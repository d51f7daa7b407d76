"""Saving the mesh layout next to the run's results, through Ray Train's storage.

Writing goes through the run's own ``StorageContext`` filesystem (Ray Train's, so cloud
storage works as well as a local path) on rank 0's worker, called by the backend right
after bring-up. A failure to save only logs a warning: the layout is a view, not a reason
to stop a run. The documents themselves come from ``ray_mesh.observability.layout``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import ray
import ray.train

from ray_mesh.core.layout import Layout
from ray_mesh.core.topology import MeshPlan
from ray_mesh.observability.layout import LAYOUT_JSON, LAYOUT_MD, layout_document, to_markdown
from ray_mesh.raytrain.preflight import AsyncWorkerGroup

logger = logging.getLogger(__name__)

SAVE_TIMEOUT_S = 30.0


def _write_on_worker(doc: dict[str, Any]) -> str:
    """Runs on rank 0's worker: write both files into the run directory; returns its path."""
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


def save_layout(worker_group: AsyncWorkerGroup, plan: MeshPlan,
                interfaces: dict[int, str], layout: Layout | None = None) -> str | None:
    """From the backend (controller): have rank 0 save the layout. Never raises."""
    try:
        doc = layout_document(plan, interfaces, layout=layout)
        # Bounded: slow storage must not hold up the start of training for long.
        ref = worker_group.execute_single_async(0, _write_on_worker, doc)
        run_dir = ray.get(ref, timeout=SAVE_TIMEOUT_S)
        logger.info("ray_mesh: mesh layout saved to %s/%s (and .md)", run_dir, LAYOUT_JSON)
        return run_dir
    except Exception as exc:  # noqa: BLE001 - a view must not stop the run
        logger.warning("ray_mesh: could not save the mesh layout (%s: %s); the run goes on, "
                       "the layout table is in rank 0's log.", type(exc).__name__, exc)
        return None
