"""Link measurement and ``mesh="auto"`` at bring-up (Ray Train controller side).

The backend measures the node links once per cluster, on one worker per node over the
interfaces the collectives will use (``ray_mesh.network.links``), and keeps the matrix:

* cached for :data:`CACHE_TTL_S` in a file on the node that runs the Train controller,
  keyed by the nodes' chosen addresses, so a second run (or a restart after a failure)
  on the same cluster does not pay for it again; ``MeshConfig(measure_links=True)``
  forces a fresh measurement, ``False`` skips it (single-node runs never measure);
* handed to rank 0 (``LinkMatrix.exported``: every link up to 16 nodes, at most 3 per node
  past that), which exports it with every wait window as the ``ray_mesh_link_mbit`` gauge
  (tags ``run``, ``a``, ``b``; ``ray_mesh.observability.export`` ``WindowExporter``) for
  ``ray-mesh status`` and the dashboard: a gauge set once here, on the controller, would
  expire from Ray's endpoint within ~20 s;
* used by ``mesh="auto"`` to pick the layout with the lowest predicted step time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import ray

from ray_mesh.core.files import write_atomic
from ray_mesh.core.layout import DiLoCoConfig, Layout
from ray_mesh.network.interfaces import Choice
from ray_mesh.network.links import LinkMatrix, measure_links
from ray_mesh.planning.cost import Links, Prediction, explain_pick, format_ranked
from ray_mesh.planning.inputs import PlanInputs

logger = logging.getLogger(__name__)

CACHE_TTL_S = 600.0
CACHE_FILE = Path(os.environ.get("RAY_MESH_CACHE_DIR", Path.home() / ".cache" / "ray_mesh")) \
    / "links.json"


def node_leaders(node_ranks: Sequence[int]) -> list[int]:
    """The first world rank on each node, in node order (``node_ranks[r]`` = r's node)."""
    first: dict[int, int] = {}
    for rank, node in enumerate(node_ranks):
        first.setdefault(node, rank)
    return [first[k] for k in sorted(first)]


def _cache_key(addresses: Sequence[str]) -> str:
    return ",".join(sorted(addresses))


def cached(addresses: Sequence[str], ttl_s: float = CACHE_TTL_S) -> LinkMatrix | None:
    try:
        entry = json.loads(CACHE_FILE.read_text()).get(_cache_key(addresses))
    except (OSError, ValueError):
        return None
    if not entry or time.time() - float(entry.get("at", 0)) > ttl_s:
        return None
    return LinkMatrix.from_json(entry["links"])


def store(addresses: Sequence[str], matrix: LinkMatrix) -> None:
    try:
        CACHE_FILE.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            data = json.loads(CACHE_FILE.read_text())
        except (OSError, ValueError):
            data = {}
        data[_cache_key(addresses)] = {"at": time.time(), "links": matrix.to_json()}
        write_atomic(CACHE_FILE, json.dumps(data))
    except OSError as exc:  # a cache that cannot be written costs a re-measure, nothing else
        logger.debug("ray_mesh: link cache not written: %s", exc)


def measure_worker_group(worker_group, leaders: Sequence[int], choices: Sequence[Choice],
                         mode: bool | str, max_s: float) -> LinkMatrix | None:
    """The link matrix of the nodes behind ``leaders`` (cached unless ``mode`` is True)."""
    if mode is False or len(leaders) < 2:
        return None
    addresses = [choices[r].address for r in leaders]
    if mode is not True and (hit := cached(addresses)) is not None:
        print(f"ray_mesh: node links (measured under {CACHE_TTL_S / 60:.0f} min ago; "
              f"MeshConfig(measure_links=True) re-measures):\n{hit.format()}", flush=True)
        return hit

    def run_on(i: int, fn, *args):
        ref = worker_group.execute_single_async(leaders[i], fn, *args)
        return ray.get(ref, timeout=max_s + 20.0)

    t0 = time.monotonic()
    matrix = measure_links(addresses, run_on, max_s=max_s)
    # The controller's stdout reaches the driver's console; its log file does not.
    print(f"ray_mesh: node links measured in {time.monotonic() - t0:.1f} s "
          f"({matrix.caption()}):\n{matrix.format()}", flush=True)
    store(addresses, matrix)
    return matrix


class Pick(NamedTuple):
    """``mesh="auto"``'s choice: the layout every worker's mesh is built for, and why."""

    layout: Layout
    why: str


def rank_for_cluster(inputs: PlanInputs, nodes: int, per_node: int,
                     matrix: LinkMatrix | None, backend: str,
                     replicate: DiLoCoConfig | None = None) -> list[Prediction]:
    """The layouts the plan allows on this cluster, fastest predicted first (the ranking and
    the node link rate it was predicted for are logged).

    ``replicate``: the job's own DiLoCo settings (its ``replicate:`` section), which make
    DiLoCo the only replicate mode allowed, with those settings.
    """
    if replicate is not None:
        inputs = replace(inputs, diloco=replicate, sync=False)
    mbit = inputs.link_mbit or (matrix.cross_node_mbit() if matrix else None)
    if mbit is None or mbit == float("inf"):
        mbit = 1e5  # one node: nothing crosses, the rate does not matter
    links = Links(nodes, per_node, float(mbit), latency_s=inputs.latency_s,
                  backend=inputs.backend or backend)
    ranked = inputs.rank(links)
    logger.info("ray_mesh: mesh=auto on %d node(s) x %d worker(s), node link %.0f Mbit/s:\n%s",
                nodes, per_node, mbit, format_ranked(ranked))
    return ranked


def pick_from(best: Prediction, why: str) -> Pick:
    """The :class:`Pick` of layout ``best`` (``why``: the reason, logged and kept on every
    worker's mesh state for the train function)."""
    print(f"ray_mesh: mesh=auto {why}", flush=True)
    return Pick(best.layout, why)


def pick_mesh(inputs: PlanInputs, nodes: int, per_node: int, matrix: LinkMatrix | None,
              backend: str, replicate: DiLoCoConfig | None = None) -> Pick:
    """The fastest predicted layout the plan allows on this cluster; logs the ranking and why
    (``mesh="auto"`` without ``plan.step``; with it, :mod:`ray_mesh.raytrain.trials`)."""
    ranked = rank_for_cluster(inputs, nodes, per_node, matrix, backend, replicate)
    why = "; ".join([explain_pick(ranked), *_variant_lines(ranked)])
    return pick_from(ranked[0], why)


def _variant_lines(ranked: list[Prediction]) -> list[str]:
    """Why the pick's gradient precision and replicate mode beat the same mesh's others."""
    best = ranked[0].layout
    same = [p for p in ranked[1:] if p.layout.mesh == best.mesh]
    lines = []
    for what, differs in ((f"gradient reduction {best.reduce}", lambda x: x.reduce != best.reduce),
                          (f"replicate {best.replicate}",
                           lambda x: x.replicate != best.replicate)):
        other = next((p for p in same if differs(p.layout)), None)
        if other is not None:
            lines.append(f"{what}: {ranked[0].step_s:.3g} s/step vs {other.layout} "
                         f"{other.step_s:.3g} s/step")
    return lines
