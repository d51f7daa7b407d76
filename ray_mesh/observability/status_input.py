"""What ``ray-mesh status`` accepts from a cluster: every field checked, or "malformed (why)".

The dashboard's JSON (nodes, Ray Train's run state), the nodes' Prometheus text and a run's
layout file are written by the cluster, not by the person reading. Each value is checked
here for its type and size before anything uses it: a rank is an integer in range, a name
is text of at most :data:`~ray_mesh.core.safe.NAME_LIMIT` characters (control
characters escaped), a number is finite. A record that fails is kept as
``malformed (why)`` for the printout, so one bad report neither crashes the command nor
hides the others, and nothing after this module sees a value it did not expect.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import re
from collections.abc import Iterable
from typing import Any

from ray_mesh.core.layout import LayoutError
from ray_mesh.core.layout import parse_layout as parse_layout_string
from ray_mesh.core.object_store import redacted
from ray_mesh.core.safe import NAME_LIMIT, safe_text
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS
from ray_mesh.core.values import brief
from ray_mesh.errors import Malformed

MAX_RANKS = 100_000  # as ray-mesh run's MAX_WORKERS: more is not a real run
MAX_RUNS = 200  # runs shown; the newest first
DIM_LABELS = frozenset((*DIM_NAMES, *FLATTENED_DIMS, "world"))
_RANK_LABEL = re.compile(r"[0-9]{1,6}")  # ASCII digits only ("²".isdigit() is True)


def shown(value: Any, limit: int = 40) -> str:
    """A short, escaped rendering of an unexpected value for a "malformed" message (bounded:
    ``repr`` of a 5000-digit integer raises, of a deep list recurses)."""
    return brief(value, limit)


def text(value: Any, what: str, limit: int = NAME_LIMIT) -> str:
    """``value`` if it is text of at most ``limit`` characters, control characters escaped."""
    if not isinstance(value, str):
        raise Malformed(f"{what} is {type(value).__name__} {shown(value)}, not text")
    if len(value) > limit:
        raise Malformed(f"{what} is {len(value)} characters long (at most {limit})")
    return safe_text(value)


def integer(value: Any, what: str, low: int = 0, high: int = MAX_RANKS) -> int:
    """``value`` if it is an integer (not a bool, not a string) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"{what} {shown(value)} is not an integer")
    if not low <= value <= high:
        raise Malformed(f"{what} {shown(value)} is outside [{low}, {high}]")
    return value


def number(value: Any, what: str) -> float:
    """A finite int or float (an integer too large for a float, 1e400 written out, is not)."""
    try:
        ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(
            value)
    except OverflowError:
        ok = False
    if not ok:
        raise Malformed(f"{what} {shown(value)} is not a finite number")
    return float(value)


def dig(doc: Any, *keys: str) -> Any:
    """``doc[k1][k2]...``, or None where a level is missing or not a mapping."""
    for key in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def load_json(data: bytes, what: str) -> Any:
    """Parsed JSON, or :class:`Malformed` (bad UTF-8, bad JSON, nesting too deep)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Malformed(f"{what} is not valid JSON ({type(exc).__name__}: "
                        f"{safe_text(exc, 120)})") from None


# ----------------------------------------------------------------------------- nodes
def parse_nodes(doc: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The dashboard's ``/api/v0/nodes`` answer -> node rows, and notes on malformed ones."""
    if dig(doc, "result") is False:
        raise Malformed(f"the node list is an error: {safe_text(dig(doc, 'msg'), 300)}")
    items = dig(doc, "data", "result", "result")
    if not isinstance(items, list):
        raise Malformed("the node list has no data.result.result list")
    nodes, notes = [], []
    for i, n in enumerate(items):
        try:
            if not isinstance(n, dict):
                raise Malformed(f"it is {type(n).__name__}, not an object")
            res = n.get("resources_total") or {}
            if not isinstance(res, dict):
                raise Malformed(f"resources_total {shown(res)} is not an object")
            nodes.append({
                "node_id": text(n.get("node_id"), "node_id", 128),
                "ip": text(n.get("node_ip"), "node_ip", 64),
                "state": text(n.get("state"), "state", 32),
                "head": bool(n.get("is_head_node") is True),
                "CPU": number(res.get("CPU", 0), "CPU"),
                "GPU": number(res.get("GPU", 0), "GPU")})
        except Malformed as exc:
            notes.append(f"node entry {i}: malformed ({exc})")
    return sorted(nodes, key=lambda n: (not n["head"], n["ip"], n["node_id"])), notes


# ----------------------------------------------------------------------------- runs
def mesh_of(run: Any) -> Any:
    """The ``mesh`` of a Train run's backend config (None: not a ray_mesh run)."""
    config = dig(run, "run_settings", "backend_config", "config")
    return config.get("mesh") if isinstance(config, dict) else None


def _worker(w: Any, i: int) -> dict[str, Any]:
    if not isinstance(w, dict):
        raise Malformed(f"worker {i} is {type(w).__name__}, not an object")
    gpus = w.get("gpu_ids") or []
    if not isinstance(gpus, list):
        raise Malformed(f"worker {i}: gpu_ids {shown(gpus)} is not a list")
    return {"rank": integer(w.get("world_rank"), f"worker {i}: world_rank"),
            "node": integer(w.get("node_rank", 0), f"worker {i}: node_rank"),
            "node_ip": text(w.get("node_ip", ""), f"worker {i}: node_ip", 64),
            "local_rank": integer(w.get("local_rank", 0), f"worker {i}: local_rank"),
            "device": "cuda" if gpus else "cpu"}


def parse_run(r: dict[str, Any]) -> dict[str, Any]:
    """A ray_mesh run of the Train state, checked: name, id, status, start, storage, workers."""
    attempts = r.get("attempts") or []
    if not isinstance(attempts, list):
        raise Malformed(f"attempts {shown(attempts)} is not a list")
    workers = dig(attempts[-1], "workers") if attempts else []
    if not isinstance(workers, list | type(None)):
        raise Malformed(f"workers {shown(workers)} is not a list")
    workers = [_worker(w, i) for i, w in enumerate((workers or [])[:MAX_RANKS + 1])]
    if len(workers) > MAX_RANKS:
        raise Malformed(f"more than {MAX_RANKS} workers")
    ranks = [w["rank"] for w in workers]
    if len(set(ranks)) != len(ranks):
        raise Malformed("two workers have the same world_rank")
    storage = dig(r, "run_settings", "run_config", "storage_path")
    fs_kind = dig(r, "run_settings", "run_config", "storage_filesystem")
    if (isinstance(storage, str) and isinstance(fs_kind, str) and "S3FileSystem" in fs_kind
            and "://" not in storage):
        storage = f"s3://{storage}"  # RunConfig(storage_filesystem=S3FileSystem(...)): a bucket
    mesh = mesh_of(r)
    if not isinstance(mesh, dict) or len(mesh) > 16:
        raise Malformed(f"the backend config's mesh {shown(mesh)} is not a mesh spec")
    return {"name": text(r.get("name"), "name"), "id": text(r.get("id"), "id"),
            "status": text(r.get("status"), "status", 32),
            "start_time_ns": integer(r.get("start_time_ns", 0), "start_time_ns", 0, 2**63),
            # Shown, never a query's values: a run started elsewhere may carry credentials.
            "storage_path": None if storage is None else text(
                redacted(storage) if isinstance(storage, str) else storage, "storage_path",
                4096),
            "storage_raw": storage if isinstance(storage, str) else None,
            "mesh": mesh, "workers": sorted(workers, key=lambda w: w["rank"]),
            "layout": layout_text(dig(r, "run_settings", "backend_config", "config", "layout"),
                                  "the backend config's layout")}


def layout_text(value: Any, what: str) -> str:
    """A layout the cluster wrote, read with the one layout parser and printed canonically
    ("?" when absent, "auto" while ``mesh='auto'`` has not picked yet)."""
    if value is None or value == "auto":
        return "?" if value is None else "auto"
    raw = text(value, what, 300)
    try:
        return str(parse_layout_string(raw))
    except LayoutError as exc:
        raise Malformed(f"{what}: {exc}") from None


def run_label(r: Any) -> str:
    """The best name a malformed run can be shown under."""
    name = dig(r, "name")
    return safe_text(name, 60) if isinstance(name, str) and name else "?"


def safe_component(name: str) -> bool:
    """Whether a run name can be a path component under the viewer's storage (no ``..``)."""
    return (bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
            and safe_text(name) == name)


# ----------------------------------------------------------------------------- layout
LAYOUT_TEXT = {"node_ip": 64, "hostname": 256, "device": 32, "interface": 64, "node_id": 128}


def parse_layout(data: bytes, what: str) -> dict[str, Any]:
    """A run's ``ray_mesh_layout.json``, checked row by row."""
    doc = load_json(data, what)
    if not isinstance(doc, dict) or not isinstance(doc.get("ranks"), list):
        raise Malformed(f"{what} is not a layout (no ranks list)")
    if len(doc["ranks"]) > MAX_RANKS:
        raise Malformed(f"{what} lists more than {MAX_RANKS} ranks")
    rows, seen = [], set()
    for i, row in enumerate(doc["ranks"]):
        if not isinstance(row, dict):
            raise Malformed(f"{what}: row {i} is not an object")
        out = {"rank": integer(row.get("rank"), f"{what}: row {i}: rank")}
        if out["rank"] in seen:
            raise Malformed(f"{what}: rank {out['rank']} appears twice")
        seen.add(out["rank"])
        node = row.get("node", "")
        out["node"] = integer(node, f"row {i}: node") if isinstance(node, int) else text(
            node, f"{what}: row {i}: node", 64)
        out["local_rank"] = integer(row.get("local_rank", 0), f"{what}: row {i}: local_rank")
        for key, limit in LAYOUT_TEXT.items():
            if key in row:
                out[key] = text(row[key], f"{what}: row {i}: {key}", limit)
        for d in DIM_NAMES:
            out[d] = integer(row.get(d, 0), f"{what}: row {i}: {d}")
        rows.append(out)
    return {"mesh": text(doc.get("mesh", "?"), f"{what}: mesh", 300),
            "layout": layout_text(doc.get("layout"), f"{what}: layout"),
            "ranks": sorted(rows, key=lambda r: r["rank"])}


# ----------------------------------------------------------------------------- metrics
def _on_node(target: Any, ips: set[str]) -> bool:
    """Whether ``target`` is ``ip:port`` (``[v6]:port``) with the IP one of ``ips``."""
    if not isinstance(target, str):
        return False
    host, _, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = str(ipaddress.ip_address(host))
    except ValueError:
        return False
    return ip in ips and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def targets_of(doc: Any, node_ips: Iterable[str]) -> tuple[list[str], list[str]]:
    """Prometheus targets (``ip:port``) on the cluster's own nodes; the others, escaped.

    Ray's service discovery lists each node's metrics agent; an address elsewhere (another
    host, a URL path, a name to resolve) is not a node's endpoint and is not asked."""
    ips = set()
    for ip in node_ips:  # a node whose IP is not one: none of its targets is asked
        with contextlib.suppress(ValueError):
            ips.add(str(ipaddress.ip_address(ip)))
    good: set[str] = set()
    bad: list[str] = []
    for group in doc[:10_000] if isinstance(doc, list) else []:
        targets = dig(group, "targets")
        for t in targets[:10_000] if isinstance(targets, list) else []:
            if _on_node(t, ips):
                good.add(t)
            else:
                bad.append(shown(t, 80))
    return sorted(good), bad


def clean_samples(samples: Iterable[tuple[str, dict, float]]
                  ) -> tuple[list[tuple[str, dict, float]], int]:
    """The samples whose labels and value are what ray_mesh exports; and how many were not.

    Label values repeat across a page (run, node, session, coordinates): each distinct one
    is escaped once (thousands of ranks' samples)."""
    out, dropped = [], 0
    escaped: dict[str, str] = {}
    for name, labels, value in samples:
        rank = labels.get("rank")
        dim = labels.get("dim")
        if (not math.isfinite(value) or len(name) > NAME_LIMIT
                or (rank is not None and not _RANK_LABEL.fullmatch(rank))
                or (dim is not None and dim not in DIM_LABELS)
                or any(len(v) > NAME_LIMIT for v in labels.values())):
            dropped += 1
            continue
        clean = {}
        for k, v in labels.items():
            e = escaped.get(v)
            if e is None:
                e = escaped[v] = safe_text(v)
            clean[k] = e
        out.append((name, clean, value))
    return out, dropped
